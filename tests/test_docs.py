"""docs/API.md is checked against the code: every call it documents (`name(param, ...)`) must exist,
and every parameter it names must be one the callable takes, so the reference cannot drift from
the code again (it once documented `endpoint(gid_index=...)` and `to_rtr(sgid_index=...)`, which
did not exist). Host test: no device needed."""
import importlib
import inspect
import pathlib
import re

import pytest

API = pathlib.Path(__file__).resolve().parent.parent / "docs" / "API.md"
# the modules each section's names come from, searched in order after the current class
SECTION_MODULES = {"Collectives": ["pyrdma.collectives", "pyrdma.collectives.communicator"],
                   "GPU": ["pyrdma.cuda", "pyrdma.cuda.collectives", "pyrdma.cuda.registration",
                           "pyrdma.cuda.buffers", "pyrdma.cuda.reduce", "pyrdma.cuda.staging",
                           "pyrdma.collectives", "pyrdma.collectives.transport", "pyrdma._engine"],
                   "Out-of-band": ["pyrdma", "pyrdma.connect", "pyrdma.endpoint"],
                   "asyncio": ["pyrdma.aio"],
                   "Environment": ["pyrdma.doctor", "pyrdma.advice", "pyrdma.collectives.communicator",
                                   "pyrdma.cuda"]}
DEFAULT_MODULES = ["pyrdma", "pyrdma.errors"]
# sections about every verbs object: their calls are checked on one of them
SECTION_CONTEXT = {"Lifetimes": "Context"}
CALL = re.compile(r"`(\.?[A-Za-z_][\w.]*)\(")


def _balanced(text, start):
    """The text inside the parentheses opening at ``text[start]``."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1:i]
    raise AssertionError(f"unbalanced parentheses in docs/API.md near {text[start:start + 60]!r}")


def _split_top(args):
    parts, depth, cur = [], 0, ""
    for ch in args:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


def documented_names(args):
    """Parameter names of a documented call: ``a, b=1 (why), *, c: T="x"|"y", **kw`` -> a, b, c."""
    names = []
    for part in _split_top(args):
        if part in ("*", "/", "...") or part.startswith("*"):
            continue
        name = re.match(r"[A-Za-z_]\w*", part)
        if name:
            names.append(name.group(0))
    return names


def actual_parameters(obj):
    """(names, takes **kwargs) of a Python or Cython callable; for a Cython class, from the
    signature embedded in its docstring (embedsignature)."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        sig = None
    if sig is not None and not (inspect.isclass(obj) and list(sig.parameters) == ["args", "kwargs"]):
        params = sig.parameters.values()
        return [p.name for p in params], any(p.kind is p.VAR_KEYWORD for p in params)
    doc = (obj.__doc__ or "").lstrip()
    m = re.match(rf"{re.escape(obj.__name__)}\((.*?)\)\s*(->.*)?\n", doc + "\n")
    assert m, f"{obj!r} has no signature to compare with (no embedded signature in its docstring)"
    names, kwargs = [], False
    for part in _split_top(m.group(1)):
        if part.startswith("**"):
            kwargs = True
            continue
        head = part.split("=")[0].strip().lstrip("*")
        if head and head != "self":
            names.append(head.split()[-1])      # "ProtectionDomain pd" -> "pd"
    return names, kwargs


def documented_calls():
    """(line number, section, class context, name, args) for every documented call; a call's
    arguments may go on over the next lines of its bullet."""
    text = API.read_text()
    section, context = None, None
    calls = []
    offset = 0
    for lineno, line in enumerate(text.splitlines(keepends=True), 1):
        if line.startswith("## "):
            section = line[3:].split(" ")[0]
            context = SECTION_CONTEXT.get(section)
        else:
            for k, m in enumerate(CALL.finditer(line)):
                name = m.group(1)
                args = " ".join(_balanced(text, offset + m.end() - 1).split())
                calls.append((lineno, section, context, name, args))
                if line.startswith("- ") and k == 0 and name[0].isupper():    # a class: its methods follow
                    context = name
        offset += len(line)
    return calls


def _resolve(section, context, name):
    modules = [importlib.import_module(m) for m in SECTION_MODULES.get(section, []) + DEFAULT_MODULES]

    def lookup(dotted):
        first, *rest = dotted.split(".")
        for mod in modules:
            if hasattr(mod, first):
                obj = getattr(mod, first)
                for attr in rest:
                    obj = getattr(obj, attr, None)
                if obj is not None:
                    return obj
        return None
    if context is not None:
        owner = lookup(context)
        if inspect.isclass(owner) and hasattr(owner, name.lstrip(".")):
            return getattr(owner, name.lstrip("."))
    return lookup(name.lstrip("."))


CALLS = documented_calls()


def test_the_reference_documents_calls():
    assert len(CALLS) > 60, "docs/API.md lost its call signatures (or this parser broke)"


@pytest.mark.parametrize("lineno,section,context,name,args", CALLS,
                         ids=[f"L{c[0]}-{c[3]}" for c in CALLS])
def test_documented_call_exists_as_written(lineno, section, context, name, args):
    obj = _resolve(section, context, name)
    assert obj is not None, f"docs/API.md:{lineno} documents {name}(...), which does not exist"
    assert callable(obj), f"docs/API.md:{lineno}: {name} is not callable"
    if section == "Errors":      # `Name(Base, ...)`: the exception's bases
        assert [b.__name__ for b in obj.__bases__] == documented_names(args), \
            f"docs/API.md:{lineno}: {name}'s bases are {[b.__name__ for b in obj.__bases__]}"
        return
    actual, takes_kwargs = actual_parameters(obj)
    if takes_kwargs:
        actual = actual + ["**"]
    unknown = [p for p in documented_names(args) if p not in actual]
    if unknown and not takes_kwargs:
        pytest.fail(f"docs/API.md:{lineno} documents {name}({args}) but it takes no {unknown}; "
                    f"its parameters are {actual}")
