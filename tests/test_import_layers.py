"""The import graph of `octavo/` has no cycles and no upward edges: each module imports only from
its own layer or those below (imports inside functions count too: a lazy import is still a
dependency). The layers are the architecture of docs/ARCHITECTURE.md, lowest first."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "octavo"

# Lowest first. A module belongs to the longest prefix listed; packages' __init__ go with their prefix.
LAYERS: list[tuple[str, list[str]]] = [
    ("data and leaves", [
        "octavo.config", "octavo.engine_args", "octavo.cache", "octavo.cpu_features", "octavo.threads",
        "octavo.quantization", "octavo.memory", "octavo.sampling", "octavo.sampling.params",
        "octavo.sampling.logprobs", "octavo.lora.request", "octavo.beam_search", "octavo.structured.schema",
        "octavo.kernels.metadata", "octavo.tokenizer", "octavo.detokenizer", "octavo.planner",
        "octavo.simulator.workload", "octavo.json_limits",
    ]),
    ("scheduling state (pure Python)", [
        "octavo.request", "octavo.request_queue", "octavo.outputs", "octavo.kv_cache", "octavo.spec_decode", "octavo.scheduler", "octavo.dashboard",
        "octavo.metrics", "octavo.structured", "octavo.simulator",
    ]),
    ("kernels and the KV tier's storage", ["octavo.kernels", "octavo.kv_tier"]),
    ("models and what wraps them", [
        "octavo.models", "octavo.lora", "octavo.sampling.sampler", "octavo.cuda_graphs", "octavo.distributed.layers",
    ]),
    ("the runner and its ranks", ["octavo.model_runner", "octavo.draft_model", "octavo.distributed"]),
    ("the engine", ["octavo.output_processor", "octavo.engine", "octavo.llm", "octavo.bench"]),
    ("serving", ["octavo.server", "octavo.router"]),
    ("entry points", ["octavo.cli", "octavo.__main__"]),
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
    """Octavo modules `module` imports anywhere (TYPE_CHECKING blocks excepted). The root package
    counts only its top level: its lazy `__getattr__` is the public facade over the engine."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
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
