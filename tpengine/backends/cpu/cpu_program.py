"""A decoder stack's batch-1 decode step as one C call (``cpu_program.c``): the CPU backend's bound
implementation of :meth:`tpengine.model.layers.fused.DecoderStack.forward` for a step of one token on
the paged path.

Why: at one token a step a decoder layer's kernels take microseconds each, and the Python between them
(the layers' forwards, ctypes' conversion of each argument, an output tensor per call) costs as much
again (docs/notes/kernels.md). :func:`bind` collects, from the layers' own bound kernels, the C call
each one makes for one row (the ``c_spec`` their binders attach: the add + RMSNorm, the q/k/v, o,
gate/up and down products in whatever layout or quantization each weight took, the paged decode
attention with RoPE and the KV store, the MLP's activation), gives each output a buffer of its own,
and encodes the calls in the order the forward makes them. Running the program makes exactly those
calls with those arguments, so its output is bit for bit the forward's; the forward keeps its own
path for everything the program does not take (:func:`bind` returns None, or the step is not one token
on the paged path).

At tp > 1 the norms all-reduce the row-parallel partial sums first (``reduce_in_norm``): those ops are
the shared-memory comm's fused all-reduce + add + RMSNorm (``cpu_shm.c``, the call
``ShmComm.all_reduce_add_rms_norm`` makes); one whose wait outlasts its C spin hands the wait back, and
:meth:`Program.__call__` finishes it with the comm's bounded, peer-checking wait, then resumes.

A greedy step at one rank (the model runner asks through ``Context.greedy``: temperature 0 for every
sequence, no grammar mask, no logits wanted) may also make the LM head's one-row product and the C row
argmax in the same call (:meth:`Program.bind_greedy`, :meth:`Program.greedy`): the calls the head's bound
product and its greedy pick make from Python after the program, so the token ids are the same; a head
without a C call at one row, a vocabulary-parallel head, or one with logit transforms keeps its own path.

What it takes: one rank, or a TP group on this host with the shared-memory comm (not gloo), a whole
stack (no pipeline stage), layers of the Llama form (a pre-norm
before each block and no post-norms, no residual scale, one RoPE table, no LongRoPE, no per-head q/k
norms, no bias on any product, a gated MLP whose activation has a kernel, no mixture of experts), and a
C call for every kernel at one row (a weight in oneDNN's packed layout, or one whose one-row path is
``F.linear``, has none).
"""

from __future__ import annotations

import ctypes
import struct

import torch

from tpengine import distributed, forensics
from tpengine.backends.cpu import cpu_fused, cpu_library, measured, shm

#: int64 words an op takes (``TPE_OP_WORDS`` in cpu_program.c): signature, per-step mask, function, arguments
WORDS = 32
#: the signatures of cpu_program.c (``SIG_*``), by the ``c_spec`` kind that names them
SIGNATURES = {"norm": 1, "lin": 2, "q8": 3, "q4": 4, "act": 5, "paged": 6, "paged_i8": 7, "shm_norm": 8,
              "argmax": 9}
#: the per-step values (the ``params`` array's slots): RoPE's cos and sin ``[1, D]``, the slot mapping,
#: the block table and its width, the context lengths, the input row (the embedding's output), and at
#: tp > 1 the generation of the step's first shared-memory all-reduce (``GEN_SLOT`` in cpu_program.c)
COS, SIN, SLOTS, TABLES, TABLE_WIDTH, LENS, H_IN, GEN = range(8)


class Step:
    """A per-step argument of an op: the ``params`` slot it is read from (:data:`COS` ...)."""

    __slots__ = ("slot",)

    def __init__(self, slot: int):
        self.slot = slot


def _word(v) -> int:
    """An argument as an int64 word: an int as it is, a float as the bits of a double."""
    if isinstance(v, float):
        return struct.unpack("<q", struct.pack("<d", v))[0]
    return int(v)


class Program:
    """The encoded ops of one stack (``ops [n, WORDS]`` int64), the buffers they write, and
    ``params``, the per-step values. Call it as the bound decode step (:meth:`__call__`)."""

    def __init__(self, hidden: int, dtype: torch.dtype):
        self.rows: list[list[int]] = []
        self.buffers: list[torch.Tensor] = []  # every output's buffer, kept alive with the program
        self.named: dict[str, torch.Tensor] = {}
        self.hidden, self.dtype = hidden, dtype
        self.params = (ctypes.c_int64 * 8)()
        self.out: torch.Tensor | None = None
        self.ops: torch.Tensor | None = None
        self.comm = None  # tp > 1: the shared-memory comm its all-reduces go through (tpengine.backends.cpu.shm)
        # op index -> (ordinal, t, h or None (the input row), weight, eps, h2, y) of each all-reduce + norm
        self.shm_ops: dict[int, tuple] = {}
        # a greedy step's ops (bind_greedy): the stack's n_ops, then the head's product and the argmax; its ids
        self.n_greedy = 0
        self.ids: torch.Tensor | None = None
        self.head_impl = None

    def buffer(self, width: int, tag: str | None = None) -> torch.Tensor:
        """A ``[1, width]`` buffer of the activations' dtype: the one named ``tag`` (every layer's calls
        reuse their buffers, which stay in the cache), else a new one."""
        t = self.named.get(tag) if tag is not None else None
        if t is None or t.shape[1] != width:
            t = torch.zeros(1, width, dtype=self.dtype)
            self.buffers.append(t)
            if tag is not None:
                self.named[tag] = t
        return t

    def add(self, kind: str, fn_name: str, args: list) -> None:
        """Append a call of the library's ``fn_name`` with ``args`` (ints, floats, :class:`Step`)."""
        if len(args) > WORDS - 3:
            raise ValueError(f"cpu program: {fn_name} takes {len(args)} arguments, at most {WORDS - 3}")
        lib = cpu_library.load()
        fn = ctypes.cast(lib[fn_name], ctypes.c_void_p).value  # (by item: the function, never called from here)
        mask, words = 0, []
        for i, a in enumerate(args):
            if isinstance(a, Step):
                mask |= 1 << i
                words.append(a.slot)
            else:
                words.append(_word(0 if a is None else a))
        self.rows.append([SIGNATURES[kind], mask, fn, *words, *[0] * (WORDS - 3 - len(words))])

    def finish(self, out: torch.Tensor) -> Program:
        """Freeze the ops; ``out`` is the buffer the last op writes (the step's output)."""
        self.ops = torch.tensor(self.rows, dtype=torch.int64)
        self.out = out
        self.run_fn = cpu_library.load().tpe_program_run
        self.ops_p, self.n_ops, self.params_p = self.ops.data_ptr(), len(self.rows), ctypes.addressof(self.params)
        self.n_shm = len(self.shm_ops)
        return self

    def __call__(self, h: torch.Tensor, rope, index) -> torch.Tensor:
        """One step: ``h [1, hidden]`` contiguous (the embedding's row), ``rope`` the step's
        :class:`tpengine.backends.cpu.cpu_paged.Rope`, ``index`` its
        :class:`~tpengine.backends.cpu.cpu_paged.PagedIndex` -> the final norm's output ``[1, hidden]``.

        Raises:
            RuntimeError: a kernel refused its arguments (a slot, length or block id out of range: the
                KV cache of the layers before it was written, with the same values the forward writes).
        """
        p = self.params
        p[COS], p[SIN], p[H_IN] = rope.cos_p, rope.sin_p, h.data_ptr()
        p[SLOTS], p[TABLES], p[LENS] = (index.slot_mapping.data_ptr(), index.block_tables.data_ptr(),
                                        index.context_lens.data_ptr())
        p[TABLE_WIDTH] = index.block_tables.shape[1]
        comm, start = self.comm, 0
        if comm is None:
            r = self.run_fn(self.ops_p, self.n_ops, self.params_p, 0)
            if r >= 0:
                raise RuntimeError(f"cpu program: op {r >> 2} of {self.n_ops} ({self.describe(r >> 2)}) refused its "
                                   "arguments")
            return self.out.clone()
        base = comm.gen  # this step's all-reduces are the comm's next n_shm calls
        p[GEN] = base + 1
        prev = forensics.enter("decode program (all-reduce + RMSNorm of the activations in shared memory)")
        upto = 0  # the ops run (their all-reduces made) so far
        try:
            while True:
                r = self.run_fn(self.ops_p, self.n_ops, self.params_p, start)
                if r < 0:
                    upto = self.n_ops
                    break
                i, code = r >> 2, r & 3
                upto = i + (code != 0)
                if code == 0:
                    raise RuntimeError(f"cpu program: op {i} of {self.n_ops} ({self.describe(i)}) refused its "
                                       "arguments")
                self._finish(i, code == 2, base, h)
                start = i + 1
        finally:  # the comm counts the calls this rank made (all of them but on an error)
            comm.gen = base + (self.n_shm if upto == self.n_ops else sum(1 for j in self.shm_ops if j < upto))
        forensics.leave(prev)
        return self.out.clone()

    def greedy(self, h: torch.Tensor, rope, index) -> torch.Tensor:
        """One greedy step (:meth:`bind_greedy` bound the head): :meth:`__call__`'s ops, then the tied head's
        product of the final norm's row and its argmax, in the same C call -> the token id ``[1]`` int64
        (the first index of the maximum over the real vocabulary, as the head's greedy pick gives it); the
        final norm's row stays in :attr:`out`. Raises RuntimeError as :meth:`__call__`."""
        p = self.params
        p[COS], p[SIN], p[H_IN] = rope.cos_p, rope.sin_p, h.data_ptr()
        p[SLOTS], p[TABLES], p[LENS] = (index.slot_mapping.data_ptr(), index.block_tables.data_ptr(),
                                        index.context_lens.data_ptr())
        p[TABLE_WIDTH] = index.block_tables.shape[1]
        r = self.run_fn(self.ops_p, self.n_greedy, self.params_p, 0)
        if r >= 0:
            raise RuntimeError(f"cpu program: op {r >> 2} of {self.n_greedy} ({self.describe(r >> 2)}) refused its "
                               "arguments")
        return self.ids.clone()

    def bind_greedy(self, head) -> str | None:
        """Append a greedy step's ops after the stack's (:meth:`greedy`): the LM ``head``'s one-row product
        (the ``c_spec`` of its bound ``impl``: the call ``head._rows`` makes at one row, in whatever layout
        or quantization the head took) of the final norm's row into a logits buffer ``[1, n]``, then the C
        row argmax (``tpe_row_argmax_*``, cpu_argmax.c) of its first ``vocab_size`` columns -- the ids
        :meth:`~tpengine.model.layers.embedding.ParallelLMHead.greedy` returns at one rank (its C argmax or
        torch's blocked passes: the same first index). Only a one-rank program (no shared-memory comm) and
        a head of the whole vocabulary without logit transforms or bias; returns why not (the head then
        keeps its own path), or None (bound)."""
        spec = _spec(getattr(head, "impl", None))
        if self.comm is not None or head.vocab_start != 0 or head.vocab_end < head.vocab_size:
            return "a vocabulary-parallel head"
        if head.transforms or getattr(head, "bias", None) is not None:
            return "logit transforms or a bias"
        if spec is None or spec[0] not in PRODUCTS or self.dtype not in (torch.float32, torch.bfloat16):
            return "no C call for the head at one row, or logits without the C argmax"
        n, k = product_shape(spec)
        argmax = "tpe_row_argmax_bf16" if self.dtype == torch.bfloat16 else "tpe_row_argmax_f32"
        if k != self.hidden or n < head.vocab_size or not cpu_library.has(argmax):
            return "a head of another shape, or no C argmax"
        # the head's own one-row call gives logits [1, n] of the activations' dtype (the program's buffer)
        probe = head._rows(torch.zeros(1, k, dtype=self.dtype))
        if probe.dtype != self.dtype or tuple(probe.shape) != (1, n):
            return "the head's logits in another dtype or shape"
        n_stack, nt = len(self.rows), torch.get_num_threads()
        logits, ids = torch.zeros(1, n, dtype=self.dtype), torch.zeros(1, dtype=torch.int64)
        self.buffers += [logits, ids]
        self.head_impl = head.impl  # (its weight, whose address the op holds, lives as long as the program)
        _add_product(self, spec, self.out.data_ptr(), logits, nt)
        self.add("argmax", argmax, [logits.data_ptr(), 1, head.vocab_size, n, ids.data_ptr(), nt])
        self.ops = torch.tensor(self.rows, dtype=torch.int64)
        del self.rows[n_stack:]  # (the stack's ops stay the first n_ops: bind_greedy again starts from them)
        self.ops_p, self.ids, self.n_greedy = self.ops.data_ptr(), ids, n_stack + 2
        return None

    def _finish(self, i: int, published: bool, base: int, h_in: torch.Tensor) -> None:
        """Op ``i``, an all-reduce + norm whose C call stopped waiting for the peers: the comm's own wait
        (bounded, checking the peers: :meth:`tpengine.backends.cpu.shm.ShmComm._finish`), then the add +
        norm into the op's buffers, as ``ShmComm.all_reduce_add_rms_norm`` finishes such a call."""
        ordinal, t, h, weight, eps, h2, y = self.shm_ops[i]
        self.comm._finish(t, base + 1 + ordinal, published=published)
        a, b = cpu_fused.add_rms_norm(h_in if h is None else h, t, weight, eps, True)
        h2.copy_(a)
        y.copy_(b)

    def describe(self, i: int) -> str:
        """Op ``i``'s signature name."""
        sig = int(self.ops[i, 0])
        return next((k for k, v in SIGNATURES.items() if v == sig), str(sig))


def _spec(fn) -> tuple | None:
    return getattr(fn, "c_spec", None) if fn is not None else None


def _linear(prog: Program, lin, x, nt: int, tag: str) -> torch.Tensor | None:
    """Append ``lin``'s one-row product of ``x`` (an address or :class:`Step`); returns its output
    buffer, or None where the layer has no C call at one row (or a bias, added outside its kernel)."""
    spec = _spec(getattr(lin, "impl", None))
    if spec is None or getattr(lin, "bias", None) is not None or spec[0] not in PRODUCTS:
        return None
    y = prog.buffer(product_shape(spec)[0], tag)
    _add_product(prog, spec, x, y, nt)
    return y


#: the ``c_spec`` kinds of a one-row product: a float weight's ("lin"), an int8 one's ("q8"), an int4 one's ("q4")
PRODUCTS = ("lin", "q8", "q4")


def product_shape(spec: tuple) -> tuple[int, int]:
    """``(n, k)``, the weight shape of a product's ``c_spec`` (a kind of :data:`PRODUCTS`)."""
    kind, _, k, *c = spec
    return c[{"lin": 1, "q8": 2, "q4": 4}[kind]], k


def _add_product(prog: Program, spec: tuple, x, y: torch.Tensor, nt: int) -> None:
    """Append the one-row product ``spec`` (a kind of :data:`PRODUCTS`) of ``x`` (an address or :class:`Step`)
    into ``y``."""
    kind, name, k, *c = spec
    prog.add(kind, name, [x, 1, k, *c[:-1], y.data_ptr(), c[-1], nt] if kind != "lin" else
             [x, 1, k, *c, y.data_ptr(), nt])


def _paged(prog: Program, spec: tuple, qkv: torch.Tensor, nt: int) -> torch.Tensor:
    """Append the paged decode attention of ``spec`` (:func:`tpengine.backends.cpu.cpu_paged.bind`'s
    call) on the ``qkv`` buffer; returns its output buffer ``[1, Hq D]``."""
    _, name, hq, hkv, d, es, kp, vp, sp, nb, bs, mp, scale, amx, window, cap = spec
    x, rs = qkv.data_ptr(), (hq + 2 * hkv) * d
    out = prog.buffer(hq * d, "attn")
    head = [x, rs, x + hq * d * es, rs, x + (hq + hkv) * d * es, rs, Step(COS), Step(SIN), Step(SLOTS), Step(TABLES),
            Step(TABLE_WIDTH), Step(LENS), kp, vp]
    if sp is not None:
        prog.add("paged_i8", name, [*head, *sp, nb, bs, mp, hq, hkv, d, float(scale), out.data_ptr(), 1, nt, window,
                                    float(cap)])
    else:
        prog.add("paged", name, [*head, nb, bs, mp, hq, hkv, d, float(scale), out.data_ptr(), 1, amx, nt, window,
                                 float(cap)])
    return out


def runs() -> bool:
    """Whether the library has the program runner (``tpe_program_run``). Never raises."""
    return cpu_library.has("tpe_program_run")


def one_row_us(specs: list[tuple], dtype: torch.dtype) -> float:
    """Microseconds per call of one-row products as a decode program makes them: ``specs`` are bound
    products' ``c_spec`` of one kind of :data:`PRODUCTS` (e.g. ``("lin", fn, k, weight address, n)``; a quantized
    weight's "q8" or "q4" call) and one shape ``[n, k]`` (their weights kept alive by the caller), each made on
    one row of ``dtype`` by a program of that one op, the
    calls timed in turn by :func:`tpengine.backends.cpu.measured.time_us` (the median call, so one that
    another process preempted does not count): a product's cost inside the program, with one ctypes call
    of the runner but without the Python a call from the layers' loop adds (its arguments' checks and
    conversion, an output tensor; :func:`tpengine.backends.cpu.linear_layout.choose_layouts` weighs it for
    a model that runs one).

    Raises:
        ValueError: no specs, or specs of other kinds or shapes than the first's.
    """
    if not specs or specs[0][0] not in PRODUCTS or any(
            s[0] != specs[0][0] or product_shape(s) != product_shape(specs[0]) for s in specs):
        raise ValueError("cpu program timing: need one-row product calls of one kind and shape; got "
                         f"{[s[:1] + s[2:] for s in specs]}")
    n, k = product_shape(specs[0])
    x, y = torch.full((1, k), 0.5, dtype=dtype), torch.empty(1, n, dtype=dtype)
    nt, progs = torch.get_num_threads(), []
    for spec in specs:
        prog = Program(k, dtype)
        _add_product(prog, spec, x.data_ptr(), y, nt)
        progs.append(prog.finish(y))
    fn = progs[0].run_fn
    return measured.time_us([lambda p=p: fn(p.ops_p, 1, p.params_p, 0) for p in progs])


def shm_comm(stack, dtype: torch.dtype):
    """The shared-memory comm a tp > 1 program's all-reduces go through: the installed activation comm
    where it has the fused C call and one row of ``stack``'s hidden size in ``dtype`` fits its slots, else
    None."""
    comm = distributed.activation_comm()
    if comm is None or getattr(comm, "_fused", None) is None or dtype not in (torch.float32, torch.bfloat16):
        return None
    return comm if comm._fits(torch.empty(1, stack.config.hidden_size, dtype=dtype)) else None


def form_why_not(stack, tp_size: int, dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Why a program cannot take ``stack`` whatever its kernels (its form, see the module's docstring; known
    before the weights are loaded, for the layouts' choice), or None."""
    if not all(hasattr(stack, a) for a in ("first_stage", "norm", "roles", "reduce_in_norm", "residual_scale",
                                           "longrope_bound", "rope_types", "layers", "config")):
        return "not a decoder stack"
    if tp_size > 1 and not (stack.reduce_in_norm and shm_comm(stack, dtype) is not None):
        return "tp > 1 without the row-parallel sums in the norms over shared memory"
    if not stack.first_stage or stack.norm is None:
        return "a pipeline stage"
    if stack.residual_scale is not None or stack.longrope_bound is not None or set(stack.rope_types) != {None}:
        return "a residual scale, LongRoPE or several RoPE tables"
    if not runs():
        return "no C program runner in the library"
    n = stack.config.num_hidden_layers
    for layer, (pre_a, post_a, pre_m, post_m) in zip(stack.layers[:n], stack.roles):
        attn, mlp = layer.self_attn, layer.mlp
        if post_a is not None or post_m is not None or pre_a is None or pre_m is None:
            return "post-norms or a missing pre-norm"
        if getattr(attn, "q_norm", None) is not None or not hasattr(attn, "qkv_proj"):
            return "per-head q/k norms, or another attention"
        if not hasattr(mlp, "gate_up_proj"):
            return "a mixture of experts, or an MLP without its activation kernel"
        if any(getattr(lin, "bias", None) is not None
               for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)):
            return "a product without a C call at one row (or with a bias)"
    return None


def product_shapes(model, tp_size: int, dtype: torch.dtype) -> set[tuple[int, int]]:
    """The weight shapes ``(out, in)`` of the products a decode program of ``model`` (an HF causal LM whose
    ``model`` is the decoder stack, weights possibly still on meta) would make: its layers' q/k/v, o,
    gate/up and down; empty where its form takes none (:func:`form_why_not`)."""
    stack = getattr(model, "model", None)
    if stack is None or form_why_not(stack, tp_size, dtype) is not None:
        return set()
    return {tuple(lin.weight.shape) for layer in stack.layers[:stack.config.num_hidden_layers]
            for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
            if getattr(lin, "weight", None) is not None}


def why_not(stack, paged_calls: dict, tp_size: int, dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Why :func:`bind` takes no program for ``stack`` (its form, :func:`form_why_not`, or a kernel without
    its C call) with activations of ``dtype``, or None."""
    form = form_why_not(stack, tp_size, dtype)
    if form is not None:
        return form
    n = stack.config.num_hidden_layers
    for layer, (pre_a, _, pre_m, _) in zip(stack.layers[:n], stack.roles):
        attn, mlp = layer.self_attn, layer.mlp
        if not all(_spec(m.bound) for m in (pre_a, pre_m)) or (tp_size > 1 and any(
                m.weight.dtype != dtype for m in (pre_a, pre_m))):
            return "a norm without its C kernel"
        if _spec(paged_calls.get(attn.layer_idx)) is None:
            return "a layer off the paged kernel"
        if _spec(mlp.bound_act) is None:
            return "a mixture of experts, or an MLP without its activation kernel"
        for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            if _spec(lin.impl) is None:
                return "a product without a C call at one row (or with a bias)"
    return None


def bind(stack, paged_calls: dict, tp_size: int, dtype: torch.dtype) -> Program | None:
    """The decode program of ``stack`` (a :class:`~tpengine.model.layers.fused.DecoderStack` whose layers
    are bound: linears, norms, activations) with each layer's bound paged call ``paged_calls[layer_idx]``
    (:meth:`tpengine.backends.cpu.attention.CPUAttentionBackend.bind_model`), activations of ``dtype``;
    None where :func:`why_not` gives a reason. The program's kernels take ``torch.get_num_threads()``
    threads, as the layers' calls do."""
    if why_not(stack, paged_calls, tp_size, dtype) is not None:
        return None
    nt, n = torch.get_num_threads(), stack.config.num_hidden_layers
    prog = Program(stack.config.hidden_size, dtype)
    res = [prog.buffer(prog.hidden), prog.buffer(prog.hidden)]  # the residual stream, in turn
    h, delta, turn = Step(H_IN), None, 0
    if tp_size > 1:  # each norm after a block all-reduces its row-parallel partial sum first (reduce_in_norm)
        prog.comm = comm = shm_comm(stack, dtype)
        shm_fn = "tpe_shm_all_reduce_add_rms_norm"
        head = [comm._base, comm.slot_bytes, comm.size, comm.rank]

    def norm(module, y: torch.Tensor) -> None:
        nonlocal h, turn
        _, name, wp, width, eps = _spec(module.bound)
        if delta is None:  # the first layer's: h itself, normed
            prog.add("norm", name, [h, 0, wp, 0, y.data_ptr(), 1, width, float(eps), nt])
            return
        cur = None if isinstance(h, Step) else res[turn ^ 1]  # h's buffer (None: the input row)
        h2 = res[turn]
        turn ^= 1
        if prog.comm is None:
            prog.add("norm", name, [h, delta.data_ptr(), wp, h2.data_ptr(), y.data_ptr(), 1, width, float(eps), nt])
        else:  # (shm.SPIN_NS: the C wait's spin before it hands the wait back, Program._finish)
            prog.shm_ops[len(prog.rows)] = (len(prog.shm_ops), delta, cur, module.weight, float(eps), h2, y)
            prog.add("shm_norm", shm_fn, [*head, len(prog.shm_ops) - 1, delta.data_ptr(), 1, width,
                                          int(dtype == torch.bfloat16), shm.SPIN_NS, h, wp, h2.data_ptr(),
                                          y.data_ptr(), float(eps), nt])
        h = h2.data_ptr()

    x = prog.buffer(prog.hidden, "x")
    for layer, (pre_a, _, pre_m, _) in zip(stack.layers[:n], stack.roles):
        attn, mlp = layer.self_attn, layer.mlp
        norm(pre_a, x)
        qkv = _linear(prog, attn.qkv_proj, x.data_ptr(), nt, "qkv")
        out = _paged(prog, _spec(paged_calls[attn.layer_idx]), qkv, nt)
        delta = _linear(prog, attn.o_proj, out.data_ptr(), nt, "delta")  # (read by the next norm only)
        norm(pre_m, x)
        gu = _linear(prog, mlp.gate_up_proj, x.data_ptr(), nt, "gate_up")
        _, act_name, inter = _spec(mlp.bound_act)
        a = prog.buffer(inter, "act")
        prog.add("act", act_name, [gu.data_ptr(), a.data_ptr(), 1, inter, nt])
        delta = _linear(prog, mlp.down_proj, a.data_ptr(), nt, "delta")
    y = prog.buffer(prog.hidden)
    norm(stack.norm, y)
    return prog.finish(y)
