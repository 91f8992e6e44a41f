"""The import graph of `octavo/` has no cycles and no upward edges: each module imports only from
its own layer or those below (imports inside functions and type-only imports under TYPE_CHECKING
count too: a lazy import or a type hint is still a dependency). The layers are the architecture of
docs/ARCHITECTURE.md, lowest first. Server modules reach the engine only through AsyncEngine's
public methods."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "octavo"

# Lowest first. A module belongs to the longest prefix listed; packages' __init__ go with their prefix.
LAYERS: list[tuple[str, list[str]]] = [
    ("data and leaves", [
        "octavo.config", "octavo.cache", "octavo.cpu_features", "octavo.memory_bandwidth", "octavo.threads", "octavo.hf_fields",
        "octavo.quantization", "octavo.sampling", "octavo.sampling.params",
        "octavo.sampling.logprobs", "octavo.lora.request", "octavo.beam_search", "octavo.structured.schema",
        "octavo.kernels.metadata", "octavo.kernels.row_paths", "octavo.tokenizer", "octavo.detokenizer",
        "octavo.simulator.workload", "octavo.json_limits", "octavo.chat_template", "octavo.forkserver",
    ]),
    ("sizing the KV cache (arithmetic)", ["octavo.memory"]),
    ("request data (what crosses a step)", ["octavo.request", "octavo.request_queue", "octavo.outputs", "octavo.pooling"]),
    ("the KV cache", ["octavo.kv_cache"]),
    ("the scheduler", ["octavo.scheduler", "octavo.limits", "octavo.policies", "octavo.spec_decode"]),
    ("readers of scheduling state", ["octavo.dashboard", "octavo.simulator", "octavo.metrics", "octavo.structured",
                                     "octavo.kv_events"]),
    ("kernels and the KV tier's storage", ["octavo.kernels", "octavo.kv_tier"]),
    ("models and what wraps them", [
        "octavo.models", "octavo.lora", "octavo.sampling.sampler", "octavo.cuda_graphs", "octavo.distributed.layers",
    ]),
    ("the runner and its ranks", ["octavo.model_runner", "octavo.spec_decode.draft_model", "octavo.distributed"]),
    ("the user's arguments", ["octavo.engine_args"]),
    ("the engine and the tools over it", [
        "octavo.output_processor", "octavo.engine_setup", "octavo.engine", "octavo.llm", "octavo.bench", "octavo.planner",
    ]),
    ("serving", ["octavo.server", "octavo.router"]),
    ("entry points", ["octavo.cli", "octavo.__main__", "octavo.ray_serve"]),
]


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _owner(name: str) -> str:
    """The module a dotted import name lands in (`octavo.request.Request` -> `octavo.request`)."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _imports(module: str) -> set[str]:
    """Octavo modules `module` imports anywhere, TYPE_CHECKING blocks included. The root package
    counts only its top level: its lazy `__getattr__` is the public facade over the engine, and its
    TYPE_CHECKING block names that facade's types for readers' tools."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if module == "octavo" and isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import) and (top or module != "octavo"):
                found.update(_owner(a.name) for a in child.names if a.name.split(".")[0] == "octavo")
            elif isinstance(child, ast.ImportFrom) and (top or module != "octavo"):
                base = child.module or ""
                if child.level:
                    pkg = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join([*pkg, base] if base else pkg)
                if base.split(".")[0] == "octavo":
                    found.update(_owner(f"{base}.{a.name}") for a in child.names)
            visit(child, top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(ast.parse(path.read_text()), True)
    found.discard(module)
    return found


def _layer(module: str) -> int:
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = i, len(p)
    if module == "octavo":
        return 0
    assert best is not None, f"{module} is in no layer of {__file__}: place it"
    return best


GRAPH = {m: _imports(m) for m in MODULES}


def test_every_module_has_a_layer_and_imports_nothing_above_it():
    upward = [
        f"{m} ({LAYERS[_layer(m)][0]}) imports {d} ({LAYERS[_layer(d)][0]})"
        for m, deps in sorted(GRAPH.items()) for d in sorted(deps) if _layer(d) > _layer(m)
    ]
    assert not upward, "upward imports:\n" + "\n".join(upward)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each a cycle or several."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    assert _cycles(GRAPH) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_routes_import_no_other_route_and_reach_the_engine_only_through_async_engine():
    routes = [m for m in MODULES if m.startswith("octavo.server.routes.")]
    crossing = [(m, d) for m in routes for d in GRAPH[m] if d.startswith("octavo.server.routes.")]
    assert not crossing, f"routes importing routes (share through octavo.server.core): {crossing}"
    server = [m for m in MODULES if m.startswith("octavo.server.") and m != "octavo.server.async_engine"]
    reaching = [m for m in server if ".engine.engine" in MODULES[m].read_text()
                or "octavo.engine" in GRAPH[m]]
    assert not reaching, f"server modules reaching past AsyncEngine into LLMEngine: {reaching}"


def _async_engine_public_names() -> set[str]:
    """AsyncEngine's public methods and properties (its `engine` attribute is not among them)."""
    tree = ast.parse(MODULES["octavo.server.async_engine"].read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "AsyncEngine"]
    names = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return {n for n in names if not n.startswith("_")} | {"metrics", "error"}


def _engine_uses(module: str) -> list[tuple[int, str]]:
    """(line, attribute) of every `<something>.engine.<attribute>` or `engine.<attribute>` read in
    the module: what it asks of the engine object it was handed."""
    found = []
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        base = node.value
        if (isinstance(base, ast.Name) and base.id == "engine") or (isinstance(base, ast.Attribute) and base.attr == "engine"):
            found.append((node.lineno, node.attr))
    return found


def test_server_modules_use_only_async_engine_public_methods():
    public = _async_engine_public_names()
    assert {"add", "abort", "dashboard_snapshot", "kv_cache_report"} <= public
    server = [m for m in MODULES if m.startswith(("octavo.server.", "octavo.router.")) and m != "octavo.server.async_engine"]
    reaching = [f"{m}:{line} .engine.{attr}" for m in sorted(server) for line, attr in _engine_uses(m) if attr not in public]
    assert not reaching, "server modules reaching past AsyncEngine's public methods:\n" + "\n".join(reaching)


def test_the_engine_use_finder_finds_a_reach_inside():
    sample = "def f(server, engine):\n    a = server.engine.scheduler\n    b = engine.call(g)\n    c = engine_b.x\n"
    import tempfile
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as fh:
        fh.write(sample)
    MODULES["sample"] = Path(fh.name)
    try:
        assert _engine_uses("sample") == [(2, "scheduler"), (3, "call")]
    finally:
        del MODULES["sample"]
        Path(fh.name).unlink()
