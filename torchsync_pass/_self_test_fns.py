"""The hook self-test's functions (see ``dynamo_hooks.self_test``), one per hook point.

The self-test compiles this file's source again on every run (fresh code objects, so it never meets
cache entries of an earlier run). It is a real file: ``torch.compile`` of a function whose source
file does not exist (``<string>``) goes through Dynamo's shared ``wrap_inline`` frame on torch 2.11
and 2.12, whose cache entries, one per self-test function, would count against the recompile limit
of every ``@torch.no_grad()`` function the user compiles.
"""
import operator  # noqa: F401 - used by the functions below

def f_item(x):
    return x * x.sum().item()

def f_tolist(x):
    a, b = x.tolist()
    return x + a + b

def f_bool(x):
    return x + 1 if bool(x.sum()) else x - 1

def f_int(x):
    return x * int(x.sum())

def f_float(x):
    return x * float(x.sum())

def f_index(x):
    return x * operator.index(x.sum())

def f_jump(x):
    if x.sum() > 0:
        return x + 1
    return x - 1

def f_subscript(x):
    return x * x[x.sum() - 4]

def f_row_grad(x):
    row = x[x.sum() - 4]
    return x * row * (7 if row.grad is not None else 5)

def f_is(x):
    y = x + 1
    return x * 2 if y is x else x * 3

def f_contains(x):
    return x * 2 if x in {x: 1} else x * 3

def f_row_attr(x):
    row = x[x.sum() - 4]
    row.tag = 1
    return x * row

# torch._check_tensor_all, put in this file's namespace by the self-test (the private name stays in
# dynamo_hooks, the Dynamo-internal surface)
check_all = globals().get("check_all")

def f_check_all(x):
    check_all(x.sum() > 0)
    return x * 2
