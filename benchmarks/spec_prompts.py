"""The prompts of ``make bench-spec``'s batch-1 workloads. Fixed texts, so every run measures the same work.

* :data:`TASKS` (the ``copy`` workload, issue 39): rewrite a given code file or document with small
  edits, the work where prompt-lookup speculation pays (most output tokens are already in the prompt).
* :data:`EDIT_TASKS` (the ``edit`` workload, issue 59): work whose output repeats its prompt and
  itself, but not verbatim: code with renamed variables, a table reformatted, lists continued with
  changed values, a JSON document as YAML, routes written again for another resource. The speculative
  configuration was not tuned on them.
"""

from __future__ import annotations

CODE = '''\
"""Interval helpers."""


def merge_intervals(intervals):
    """Merge overlapping [start, end] intervals; returns a new sorted list."""
    if not intervals:
        return []
    ordered = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(ordered[0])]
    for start, end in ordered[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return merged


def total_length(intervals):
    """The length covered by the intervals, overlaps counted once."""
    return sum(end - start for start, end in merge_intervals(intervals))


def contains(intervals, point):
    """Whether any interval holds the point."""
    for start, end in merge_intervals(intervals):
        if start <= point <= end:
            return True
    return False


def gaps(intervals):
    """The uncovered stretches between the merged intervals."""
    merged = merge_intervals(intervals)
    return [[a[1], b[0]] for a, b in zip(merged, merged[1:])]
'''

DOC = '''\
The scheduler runs in three phases. First it admits waiting requests while there is room in the
batch and in the key-value cache. Second it builds the step: every running sequence gets one new
token, and a long prompt gets the next chunk of its prefill. Third it records what the step gave
back: each sequence appends its token, and the ones that reached a stop condition finish and give
their cache blocks back. A request that cannot get a block waits; a running sequence that cannot
grow is preempted, and it is computed again from its tokens when there is room.
'''

#: (name, user message) of each copy-heavy request, through the model's chat template.
TASKS = [
    ("rename", "Rewrite this Python file with the function merge_intervals renamed to merge_ranges. "
               "Change nothing else and output the whole file.\n\n" + CODE),
    ("docstrings", "Copy this Python file, but end every docstring with a full stop if it lacks one. "
                   "Output the whole file.\n\n" + CODE),
    ("document", "Repeat this text word for word, but write 'KV cache' instead of 'key-value cache':\n\n" + DOC),
]

ORDERS = '''\
def summarize_orders(orders):
    """Total quantity and revenue per product."""
    totals = {}
    for order in orders:
        product = order["product"]
        entry = totals.setdefault(product, {"quantity": 0, "revenue": 0.0})
        entry["quantity"] += order["quantity"]
        entry["revenue"] += order["quantity"] * order["price"]
    return totals


def top_products(orders, count):
    """The products with the highest revenue, best first."""
    totals = summarize_orders(orders)
    ranked = sorted(totals.items(), key=lambda item: item[1]["revenue"], reverse=True)
    return [product for product, entry in ranked[:count]]


def average_price(orders, product):
    """The mean unit price paid for one product."""
    prices = [order["price"] for order in orders if order["product"] == product]
    return sum(prices) / len(prices) if prices else 0.0
'''

CITIES = '''\
| city | country | population | area km2 |
|---|---|---|---|
| Tokyo | Japan | 13960000 | 2194 |
| Delhi | India | 16787000 | 1484 |
| Shanghai | China | 24870000 | 6341 |
| Sao Paulo | Brazil | 12330000 | 1521 |
| Mexico City | Mexico | 9209000 | 1485 |
| Cairo | Egypt | 9540000 | 3085 |
| Mumbai | India | 12442000 | 603 |
| Beijing | China | 21540000 | 16411 |
| Dhaka | Bangladesh | 8906000 | 306 |
| Osaka | Japan | 2691000 | 225 |
'''

SERVERS = "servers:\n" + "".join(f"  - name: web-0{i}\n    host: 10.0.1.1{i}\n    port: 800{i}\n    role: frontend\n"
                                 for i in (1, 2, 3))

EMPLOYEES = "".join(
    f"INSERT INTO employees (id, name, department, salary, start_date) VALUES ({i}, '{name}', '{dept}', {pay}, "
    f"'{date}');\n" for i, name, dept, pay, date in (
        (101, "Alice Martin", "Engineering", 98000, "2019-03-01"), (102, "Bruno Silva", "Engineering", 91000,
                                                                     "2020-07-15"),
        (103, "Chen Wei", "Marketing", 72000, "2018-11-20"), (104, "Dana Cohen", "Sales", 67000, "2021-01-04")))

SERVICE = '''\
{
  "service": "orders",
  "replicas": 3,
  "image": "registry.example.com/orders:1.4.2",
  "ports": [8080, 8443],
  "env": {"LOG_LEVEL": "info", "DB_HOST": "db.internal", "DB_PORT": 5432, "CACHE_TTL": 600},
  "resources": {"cpu": "500m", "memory": "512Mi"},
  "healthcheck": {"path": "/healthz", "interval_seconds": 10, "timeout_seconds": 2}
}
'''

ROUTES = '''\
@app.get("/users")
def list_users():
    return db.query(User).all()


@app.get("/users/{user_id}")
def get_user(user_id: int):
    return db.query(User).get(user_id)


@app.delete("/users/{user_id}")
def delete_user(user_id: int):
    db.delete(db.query(User).get(user_id))
'''

#: (name, user message) of each edit-like request (issue 59), through the model's chat template.
EDIT_TASKS = [
    ("rename-vars", "Rewrite this Python code with the variable orders renamed to sales and totals renamed to "
                    "by_product. Output the whole code.\n\n" + ORDERS),
    ("table-csv", "Convert this markdown table to CSV with a header line:\n\n" + CITIES),
    ("list-continue", "Continue this YAML list with web-04 to web-09, following the same pattern:\n\n" + SERVERS),
    ("sql-continue", "Continue these SQL inserts with ids 105 to 110, inventing new employees:\n\n" + EMPLOYEES),
    ("json-yaml", "Convert this JSON to YAML:\n\n" + SERVICE),
    ("routes-posts", "Here are API routes for users. Write the same three routes for posts (Post, post_id):\n\n"
                     + ROUTES),
]
