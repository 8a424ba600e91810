"""Speculative decoding keeps the sampled distribution the model's (issue 39): a tiny random model with a
16-token vocabulary (its logits sharpened, so proposals are often right), 10 000 unseeded samples of the
output tokens 1-3 of one prompt, with and without speculation, for temperature 1 and with top-p 0.8;
each position's two histograms pass a two-sample chi-square test (p > 0.01), for n-gram proposals and
for a draft model (the model itself). Token 0 comes from the prefill, which takes no proposals.

Verification samples each proposed position from the target's own distribution and keeps going while
the sample equals the proposal: with a proposer that puts all its mass on one token x this is the
rejection sampling of Leviathan et al. 2023 (accept x with probability min(1, p(x) / 1) = p(x); on
rejection, draw from p with x removed), so the output is distributed as the target's. The test would
see an error in the rows of the proposed positions: it tells temperature 1 from top-p 0.8 apart
(p < 1e-6) with the same counts -- at 10 000 draws p ~ 1e-37 at token 1, where the two distributions
part by at most 0.03 (the exact marginals, enumerated through HF: an expected statistic of ~215 on 15
degrees of freedom; 20 000 draws, the count before, gave ~415). Each proposer runs once: n-gram at
temperature 1, the draft model with top-p."""

from __future__ import annotations

import pytest
from conftest import make_tiny_model
from launch import NO_MEASURING, run_engine_jobs

VOCAB, DRAWS, POSITIONS = 16, 10_000, (1, 2, 3)
PROMPT = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]
K = 3


def chi2_two_sample(a: list[int], b: list[int]) -> tuple[float, int, float]:
    """Two-sample chi-square test of histograms ``a`` and ``b`` (equal totals; cells whose pooled count is
    under 10 are merged into one): (statistic, degrees of freedom, p-value). p = Q(df / 2, stat / 2), the
    regularized upper incomplete gamma function (the chi-square distribution's survival function)."""
    import torch

    assert sum(a) == sum(b)
    cells, rest = [], [0, 0]
    for x, y in zip(a, b):
        if x + y >= 10:
            cells.append((x, y))
        else:
            rest = [rest[0] + x, rest[1] + y]
    if sum(rest):
        cells.append(tuple(rest))
    stat = sum((x - y) ** 2 / (x + y) for x, y in cells)  # equal totals: sum (a - b)^2 / (a + b)
    df = len(cells) - 1
    p = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                      torch.tensor(stat / 2, dtype=torch.float64)))
    return stat, df, p


@pytest.fixture(scope="module")
def draws(tmp_path_factory):
    from safetensors.torch import load_file, save_file

    tmp = tmp_path_factory.mktemp("spec-sampling")
    model = make_tiny_model(tmp, vocab_size=VOCAB, num_hidden_layers=1, seed=3)
    weights = load_file(model / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] * 6.0  # sharper: top token ~0.5-0.9
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    base = {"model": str(model), "dtype": "float32", "max_model_len": 32, "max_num_seqs": 256,
            "max_num_batched_tokens": 2048, "num_kv_blocks": 1024, "seed": 7}
    specs = {"off": None,
             "ngram": {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                       "disable_by_batch_size": 1024},
             "draft": {"model": str(model), "num_speculative_tokens": K, "disable_by_batch_size": 1024}}
    sampling = {"t1": {"temperature": 1.0}, "top-p": {"temperature": 1.0, "top_p": 0.8}}
    jobs = []
    for sname, sp in sampling.items():
        reqs = [[f"r{i}", PROMPT, {**sp, "max_tokens": 1 + max(POSITIONS), "ignore_eos": True}] for i in range(DRAWS)]
        for name, spec in specs.items():
            if (name, sname) in (("draft", "t1"), ("ngram", "top-p")):
                continue  # each proposer once: n-gram at temperature 1, the draft model with top-p
            config = {**base, "speculative_config": spec} if spec else base
            jobs.append({"key": f"{sname}/{name}", "config": config, "requests": reqs})
    res = run_engine_jobs(tmp, 1, jobs, env=NO_MEASURING)  # every load the same default layouts
    out = {}
    for key, job in res.items():
        hist = {pos: [0] * VOCAB for pos in POSITIONS}
        for o in job["outputs"]:
            assert o["error"] is None, o["error"]
            for pos in POSITIONS:
                hist[pos][o["token_ids"][pos]] += 1
        out[key] = (hist, job["stats"])
    return out


@pytest.mark.parametrize("key", ["t1/ngram", "top-p/draft"])
def test_sampled_distribution_is_the_models(draws, key):
    sampling = key.split("/")[0]
    want, _ = draws[f"{sampling}/off"]
    got, stats = draws[key]
    # most samples' decode steps verified proposals, and some were right: the draft model proposes at
    # every step, n-gram only where the sequence's last token occurred before (the prompt holds 1-5 of
    # the 16 tokens), and its proposals are right less often on a random model than the draft's
    draft = key.endswith("draft")
    assert stats["spec_num_drafts"] >= (DRAWS if draft else DRAWS // 2), stats
    assert stats["spec_num_accepted_tokens"] >= (DRAWS // 4 if draft else 300), stats
    for pos in POSITIONS:
        stat, df, p = chi2_two_sample(got[pos], want[pos])
        assert df >= 3 and p > 0.01, (key, pos, stat, df, p, got[pos], want[pos])


def test_the_chi_square_test_tells_top_p_apart(draws):
    t1, _ = draws["t1/off"]
    top_p, _ = draws["top-p/off"]
    assert t1[1] != top_p[1]
    assert chi2_two_sample(t1[1], top_p[1])[2] < 1e-6
