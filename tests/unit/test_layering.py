"""Which parts of psgd may import which: the layers point one way (read from the source with ``ast``)."""

from __future__ import annotations

import ast
import builtins
import re
from pathlib import Path

import pytest

PSGD = Path(__file__).resolve().parents[2] / "psgd"


def imported(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (function-level imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def method_calls(names: tuple[str, ...], outside: str) -> list[str]:
    """``path:line`` of every call of a method named in ``names`` in psgd/, but under psgd/``outside``/."""
    found = []
    for path in sorted(PSGD.rglob("*.py")):
        if path.relative_to(PSGD).parts[0] == outside:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in names:
                found.append(f"{path.relative_to(PSGD)}:{node.lineno}")
    return found


def modules(package: str) -> list[Path]:
    return sorted((PSGD / package).rglob("*.py"))


@pytest.mark.parametrize("path", modules("bench"), ids=lambda p: p.name)
def test_benchmarks_do_not_import_the_command_line(path):
    """psgd/cli parses and calls the library; the benchmarks are library code that cli calls."""
    assert not {m for m in imported(path) if m == "psgd.cli" or m.startswith("psgd.cli.")}, path


def test_psgd_never_imports_pytorch():
    """PyTorch is a peer a benchmark measures against (benchmarks/torch_step.py), in an environment of its own."""
    found = [
        str(path.relative_to(PSGD))
        for path in sorted(PSGD.rglob("*.py"))
        if any(m == "torch" or m.startswith("torch.") for m in imported(path))
    ]
    assert found == []


TRANSPORTS = {"grpc", "socket", "ssl", "selectors", "psgd.proto", "psgd.wire.channel", "psgd.worker.client"}


@pytest.mark.parametrize(
    "path",
    [PSGD / "server" / "state" / "core.py", PSGD / "server" / "state" / "store.py", PSGD / "training" / "loop.py"],
    ids=lambda p: p.name,
)
def test_the_shard_core_and_the_loop_know_no_transport(path):
    found = imported(path)
    assert not found & TRANSPORTS and not any(m.startswith("psgd.link") for m in found), path


@pytest.mark.parametrize("path", modules("server"), ids=lambda p: p.name)
def test_the_shard_imports_the_wire_never_the_workers_links(path):
    """Both ends share psgd/wire (frames, segments, refusals); the shard never loads a worker's links."""
    assert not {m for m in imported(path) if m == "psgd.link" or m.startswith("psgd.link.")}, path


@pytest.mark.parametrize("path", modules("wire"), ids=lambda p: p.name)
def test_the_wire_imports_neither_end(path):
    assert not {
        m for m in imported(path) if m.split(".")[:2] in (["psgd", "link"], ["psgd", "server"], ["psgd", "worker"])
    }, path


def transport_tests(tree: ast.AST) -> list[int]:
    """Lines that compare something named ``transport`` with "auto" or "shm": a meaning spelled out again."""

    def names_transport(node: ast.AST) -> bool:
        return any(getattr(n, "id", getattr(n, "attr", None)) == "transport" for n in ast.walk(node))

    def names_a_kind(node: ast.AST) -> bool:
        return any(isinstance(n, ast.Constant) and n.value in ("auto", "shm") for n in ast.walk(node))

    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Compare) and names_transport(n) and names_a_kind(n)]


def test_what_a_transport_means_is_written_once():
    """psgd/wire says what each [cluster] transport means (which link, a data port, shared memory); no other
    module tests a transport against "auto" or "shm" (the link's and the shard's ends each did)."""
    product = [p for p in sorted(PSGD.rglob("*.py")) if p.relative_to(PSGD).parts[0] not in ("wire", "bench")]
    found = [
        f"{path.relative_to(PSGD)}:{line}"
        for path in product  # (a benchmark picks its own transports)
        for line in transport_tests(ast.parse(path.read_text(), str(path)))
    ]
    assert found == [], found
    before = ast.parse('shm = transport in ("auto", "shm")\nkind = "shm" if transport == "auto" else transport')
    assert transport_tests(before) == [1, 2]  # what the two ends wrote before


def test_the_workers_client_leaves_the_bytes_to_its_links():
    """The client decides what to retry and fans out to every shard; it never touches a socket or a stub."""
    assert not imported(PSGD / "worker" / "client.py") & {
        "socket.socket",
        "psgd.link.tcp",
        "psgd.link.grpc",
        "psgd.wire.channel",
        "psgd.wire.protocol.WireError",
    }
    source = (PSGD / "worker" / "client.py").read_text()
    assert "Stub(" not in source and "recv_into" not in source and "sendmsg" not in source


def test_links_are_composed_not_inherited():
    """A worker's link to a shard holds a control link (gRPC) and a data link (gRPC, TCP or shared memory): no link
    extends another, so none falls back to what it inherited.  A data link takes only the interface (DataLink); a
    connection may extend the connection it carries bytes for (a segment's requests go over the data port's)."""
    classes = {
        node.name: (path.name, [b.id for b in node.bases if isinstance(b, ast.Name)])
        for path in modules("link")
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.ClassDef)
    }
    extended = {
        f"{where}:{name}({', '.join(bases)})"
        for name, (where, bases) in classes.items()
        for base in bases
        if base in classes and base != "DataLink" and not (name.endswith("Connection") and base.endswith("Connection"))
    }
    assert extended == set(), sorted(extended)


@pytest.mark.parametrize(
    "path", sorted(p for p in PSGD.rglob("*.py") if "proto" not in p.parts), ids=lambda p: str(p.relative_to(PSGD))
)
def test_no_module_is_longer_than_a_sitting(path):
    """A module is one idea, split where the meaning splits, never to fit a count: this is only a smoke alarm for
    one that has grown several ideas (generated code aside)."""
    assert len(path.read_text().splitlines()) <= 600, path


#: the shard core: the only module that takes its lock, waits on its conditions or touches its private members
CORE = {PSGD / "server" / "state" / "core.py"}


def test_the_shard_core_is_one_class_with_its_fields():
    """ShardCore's whole-state methods were a mixin (CoreState) whose fields only ShardCore set: a class now keeps
    the fields it uses, and the core is split only into parts with state of their own, which it holds."""
    tree = ast.parse((PSGD / "server" / "state" / "core.py").read_text())
    (core,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ShardCore"]
    assert core.bases == [] and not (PSGD / "server" / "state" / "core_state.py").exists()


def _is_a_core(node: ast.AST) -> bool:
    """``core`` or ``<anything>.core``: how the modules name a shard core they hold."""
    return isinstance(node, ast.Name) and node.id == "core" or isinstance(node, ast.Attribute) and node.attr == "core"


def test_no_module_but_the_shard_core_takes_its_lock_or_touches_its_private_members():
    """Recovery, the pair and the replica's stream took the core's lock and called its private members (16 places):
    what they need are the core's own locked methods."""
    found = []
    for path in sorted(PSGD.rglob("*.py")):
        if path in CORE or "proto" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Attribute)
                and _is_a_core(node.value)
                and (node.attr in ("lock", "changed", "serving_changed") or node.attr.startswith("_"))
            ):
                found.append(f"{path.relative_to(PSGD)}:{node.lineno}: core.{node.attr}")
    assert found == [], found


#: what a worker's request does to a shard: its pull and push, the rows a pull reads, the peek at its registration
REQUESTS = ("pull", "push", "read_rows", "check", "live")


def test_a_request_reaches_the_core_through_one_handler():
    """A pull or a push reaches the shard core through psgd/server/net/handler.py, whichever transport carried it: the
    gRPC servicer and the data port each called the core's pull and push, and peeked at the roster, with code of
    their own (7 places)."""
    found = []
    for path in modules("server"):
        if path in CORE or path.name == "handler.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in REQUESTS:
                held = node.func.value  # core.push, or core.roster.live
                if (
                    _is_a_core(held)
                    or isinstance(held, ast.Attribute)
                    and held.attr == "roster"
                    and _is_a_core(held.value)
                ):
                    found.append(f"{path.name}:{node.lineno} {node.func.attr}")
    assert found == [], found


def server_rooms(path: Path) -> set[str]:
    """The rooms of psgd/server/ (``net``, ``durable``, ``state``) that ``path`` imports, at any depth."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else [f"{node.module}.{a.name}" for a in node.names]
            if isinstance(node, ast.ImportFrom) and node.module
            else []
        )
        found |= {n.split(".")[2] for n in names if n.startswith("psgd.server.") and n.count(".") >= 2}
    return found & {"net", "durable", "state"}


@pytest.mark.parametrize("path", modules("server/state"), ids=lambda p: p.name)
def test_the_shards_state_imports_neither_its_network_side_nor_what_keeps_it(path):
    """psgd/server/ is in rooms: state/ (the shard without any transport, and its state taken and given whole: the
    checkpoint files that state is written as are its own), net/ (gRPC, the data port, the handler) and durable/
    (recovery, replicas).  The two build on state/, never it on them."""
    assert server_rooms(path) <= {"state"}, path


@pytest.mark.parametrize("path", modules("server/durable"), ids=lambda p: p.name)
def test_what_keeps_the_shard_never_imports_its_network_side(path):
    """net/ serves what durable/ keeps (the servicer asks the pair and takes cuts), never the other way: the proof a
    Status answer carries, which the pair checks, is what both ends share (psgd/wire/proofs.py)."""
    assert server_rooms(path) <= {"state", "durable"}, path


def test_the_rooms_rule_can_fail(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("from psgd.server.durable import recovery\nfrom psgd.server import net\n")
    assert server_rooms(module) == {"durable", "net"}


def test_the_update_pass_lives_beside_the_store():
    """The shard's update pass (an optimizer over the store's weights) is psgd/server/state/update.py: the store handed
    a lambda through psgd/wire/sweep.py, whose passes both ends share, to run the optimizer in."""
    assert [c.split(":")[0] for c in method_calls(("update_flat",), outside="optim")] == ["server/state/update.py"]
    assert not {m for m in imported(PSGD / "wire" / "sweep.py") if m.startswith("psgd.optim")}


@pytest.mark.parametrize("path", modules("server"), ids=lambda p: p.name)
def test_the_shard_imports_psgd_at_the_top(path):
    """An import inside a function hides what a module needs (and any circle: see test_no_import_circle)."""
    tree = ast.parse(path.read_text(), str(path))
    inner = [
        node.lineno
        for f in ast.walk(tree)
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
        for node in ast.walk(f)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("psgd")
    ]
    assert inner == [], path


def test_the_loop_is_the_only_training_loop():
    """One place outside the models computes a training step's gradient: psgd/training/loop.py, whose step may be
    replayed as a CUDA graph (psgd/compute/graphs.py)."""
    calls = method_calls(("loss_and_grads", "loss_grads_and_dx"), outside="model")
    # the loss of an evaluation (evaluate, in training/evaluation.py) and the time a gradient takes
    # (gradient_seconds, for the lab); the step of the one loop (run_loop) is the model's loss_and_grads or the graph
    # of it, captured and run there; and the floor a small step is measured against (psgd.bench.latency.floor): a
    # bare gradient in one process and split across two, with no loop around it, twice
    assert sorted({c.split(":")[0] for c in calls}) == [
        "bench/latency.py",
        "compute/graphs.py",
        "training/evaluation.py",
        "training/loop.py",
    ], calls
    assert [c.split(":")[0] for c in calls].count("bench/latency.py") == 2, calls
    assert [c.split(":")[0] for c in calls].count("training/loop.py") == 1, calls
    assert [c.split(":")[0] for c in calls].count("training/evaluation.py") == 1, calls


def test_channels_to_shards_are_opened_in_one_place():
    """psgd/wire/channel.py opens every gRPC channel (TLS, message limits); the latency benchmark's bare echo
    server, gRPC without psgd, is its baseline."""
    opened = method_calls(("insecure_channel", "secure_channel"), outside="proto")
    assert sorted({c.split(":")[0] for c in opened}) == ["bench/latency.py", "wire/channel.py"], opened


def import_graph() -> dict[str, set[str]]:
    """psgd's modules and the psgd modules each imports, at any depth (type-checking imports included):
    ``from a.b import c`` is an arrow to a.b.c where that is a module, else to a.b."""
    names = {}
    for path in PSGD.rglob("*.py"):
        parts = path.relative_to(PSGD.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in names.items():
        arrows = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                arrows |= {
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in names else node.module for a in node.names
                }
            elif isinstance(node, ast.Import):
                arrows |= {a.name for a in node.names}
        graph[name] = {a for a in arrows if a in names and a != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, arrows = work[-1]
            step = next(arrows, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph[step]))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def test_no_import_circle():
    """No two modules of psgd import each other, however indirectly (imports inside functions count: they only
    hide a circle).  The convergence lab's results and the model registry have modules of their own for this."""
    assert circles(import_graph()) == []
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


#: what builds a job's plan, policy or optimizer (the optimizers' own classes included)
BUILDERS = {
    "PartitionPlan",
    "make_policy",
    "policy_from_cluster",
    "build_optimizer",
    "SGD",
    "Momentum",
    "Nesterov",
    "Adam",
    "AdamW",
    "build_row_optimizer",
    "RowSGD",
    "RowwiseAdagrad",
    "LazyAdam",
}


def test_a_plan_a_policy_or_an_optimizer_is_built_only_in_the_job():
    """psgd/job.py assembles a job once (describe_job, build_job): every role takes the plan, the policy and the
    optimizer from it.  They were built in nine places, the optimizer two ways."""
    homes = {"job.py", "partition.py", "tables/rules.py"}  # the row rules: the optimizers of tables
    found = []
    for path in sorted(PSGD.rglob("*.py")):
        rel = path.relative_to(PSGD)
        if str(rel) in homes or rel.parts[0] in ("policy", "optim"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", getattr(node.func, "attr", None))
                if name in BUILDERS:
                    found.append(f"{rel}:{node.lineno} {name}")
    assert found == [], found


def test_the_command_line_parses_and_calls():
    """psgd/cli holds no class of more than 60 lines: what psgd doctor and psgd status do lives in psgd/ops."""
    found = []
    for path in modules("cli"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 60:
                found.append(f"{path.name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert found == [], found


def test_the_assembled_job_has_one_name():
    """A psgd.job.Job is called ``job`` and a JobConfig ``config``: every parameter typed as one is named so, and
    no variable or parameter named ``built`` is left (it was the Job's name beside a JobConfig called ``job``)."""
    found = []
    for path in sorted(PSGD.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            named = (
                node.id
                if isinstance(node, ast.Name)
                else node.arg
                if isinstance(node, ast.arg)
                else node.attr
                if isinstance(node, ast.Attribute)
                else None
            )
            if named == "built":
                found.append(f"{path.relative_to(PSGD)}:{node.lineno}")
            typed = ast.unparse(node.annotation) if isinstance(node, ast.arg) and node.annotation else ""
            if (
                "JobConfig" in typed
                and node.arg != "config"
                or typed.strip('"') in ("Job", "Job | None")
                and node.arg != "job"
            ):
                found.append(f"{path.relative_to(PSGD)}:{node.lineno} {node.arg}: {typed}")
    assert found == [], found


def test_the_readme_layout_names_every_module():
    """The documentation's Layout table (docs/reference/layout.md) says where each part lives: every module of psgd/
    is named there, by its path or by its package's (``psgd/optim/``)."""
    text = (PSGD.parent / "docs" / "reference" / "layout.md").read_text()
    named = set(re.findall(r"`(psgd/[\w/.]*)`", text))
    missing = [
        str(path.relative_to(PSGD.parent))
        for path in sorted(PSGD.rglob("*.py"))
        if path.name != "__init__.py"
        and not any(
            str(path.relative_to(PSGD.parent)) == n
            or n.endswith("/")
            and str(path.relative_to(PSGD.parent)).startswith(n)
            for n in named
        )
    ]
    assert missing == [], missing


#: Python's own exception classes
BUILTIN_ERRORS = {
    name for name, value in vars(builtins).items() if isinstance(value, type) and issubclass(value, BaseException)
}


def test_psgd_errors_have_one_root():
    """Every error class psgd defines derives from psgd.errors' root through its kinds: only the root and three kinds
    derive straight from Python's own (InputError is a ValueError, ClusterError a RuntimeError, Interrupted a
    KeyboardInterrupt), so that the commands can print any error psgd raises on purpose as one line, and a caller
    can act on its kind."""
    straight = []
    for path in sorted(PSGD.rglob("*.py")):
        if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue  # generated code
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                bases = {b.id for b in node.bases if isinstance(b, ast.Name)}
                if bases & BUILTIN_ERRORS:
                    straight.append(f"{path.relative_to(PSGD)}:{node.name}")
    assert straight == [
        "errors.py:PsgdError",
        "errors.py:InputError",
        "errors.py:ClusterError",
        "errors.py:Interrupted",
    ], straight


#: The modules that speak gRPC: the channel and its TLS, the worker's gRPC link, the shard's servicer with its
#: token check and the peer's questions, the latency interceptor, the rich status both ends read, and the
#: operators' probes.  Everything else speaks psgd's own codes (psgd.errors.Code).
GRPC_EDGE = {
    "wire/channel.py",
    "link/grpc.py",
    "server/net/service.py",
    "server/net/tokens.py",
    "server/durable/peers.py",
    "observe/rpc_latency.py",
    "wire/status.py",
    "ops/reach.py",
}


def test_grpc_is_spoken_only_at_its_edge():
    speaking = set()
    for path in sorted(PSGD.rglob("*.py")):
        name = str(path.relative_to(PSGD))
        if path.name.endswith(("_pb2.py", "_pb2_grpc.py")) or name.startswith("bench/"):
            continue
        if any(m == "grpc" or m.startswith("grpc.") for m in imported(path)):
            speaking.add(name)
    assert speaking == GRPC_EDGE, sorted(speaking ^ GRPC_EDGE)


#: psgd's packages (and its top-level modules), from the command line down.  A package imports only packages of the
#: layers below its own, never another of its own layer, at any depth (imports inside functions count).  The loop
#: states its exchanges' contract (psgd/training/loop.py) and each mode's exchange implements it, so the modes sit
#: above the loop; the worker's links and the shard share psgd/wire and never import each other.
LAYERS = [
    {"cli"},  # the commands: they parse, then call
    {"api", "bench", "psgd"},  # psgd.train / launch / run; the benchmarks; the package's face
    {"launcher"},  # a job's processes started, watched, and its result read
    {"ops", "export"},  # status, doctor and report; a model kept from its shards
    {"worker", "collective"},  # the modes' exchanges: a worker's client and links; all-reduce
    {"training", "link", "server"},  # the one loop and its contract; a worker's links; the shard
    {"job", "observe", "weights"},  # a job assembled; what it tells its user; a model's weights as a file
    {"config", "data", "partition"},  # the job file; datasets; the partition plan
    {"wire", "tables"},  # what both ends share; embedding rows as a process holds them
    {"model", "optim", "policy", "proto", "xp"},  # networks; optimizers; policies; the generated wire code
    {"autodiff"},  # the tape
    {"compute"},  # the step's arithmetic: NumPy or CuPy
    {"errors", "moved"},  # psgd's errors; the moved names' forwarding
]


def package(module: str) -> str:
    """``psgd.worker.client`` -> ``worker``; ``psgd`` (the package's face) -> ``psgd``."""
    return module.split(".")[1] if "." in module else module


def package_graph() -> dict[str, set[str]]:
    """Every package of psgd and the other packages its modules import, at any depth."""
    graph: dict[str, set[str]] = {}
    for name, arrows in import_graph().items():
        graph.setdefault(package(name), set()).update(package(a) for a in arrows)
    return {p: arrows - {p} for p, arrows in graph.items()}


def test_every_package_has_its_layer():
    placed = [p for layer in LAYERS for p in layer]
    assert len(placed) == len(set(placed)), "a package in two layers"
    assert set(package_graph()) == set(placed), sorted(set(package_graph()) ^ set(placed))


def test_packages_import_only_the_layers_below_their_own():
    layer_of = {p: i for i, layer in enumerate(LAYERS) for p in layer}
    graph = package_graph()
    upward = sorted(f"{p} -> {a}" for p, arrows in graph.items() for a in arrows if layer_of[a] <= layer_of[p])
    assert upward == [], upward


def test_no_import_circle_between_packages():
    """Modules may form no circle, and neither may packages: ``a.x`` importing ``b.y`` while ``b.z`` imports
    ``a.w`` ties the two packages together as surely."""
    assert circles(package_graph()) == []


def function_level_imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every psgd import inside a function of ``path``."""
    return function_level_imports_of(ast.parse(path.read_text(), str(path)))


def function_level_imports_of(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                if isinstance(inner, ast.Import):
                    found += [(inner.lineno, a.name) for a in inner.names if a.name.split(".")[0] == "psgd"]
                elif isinstance(inner, ast.ImportFrom) and inner.module and inner.module.split(".")[0] == "psgd":
                    found.append((inner.lineno, inner.module))
    return sorted(set(found))  # (a function inside a function is walked twice)


#: the psgd imports a product module makes inside a function, each with its reason: everything else is imported at
#: the top of its module, where a reader sees what the module depends on
LATE_IMPORTS = {
    ("collective/__init__.py", "psgd.collective.mpi"): "mpi4py loads only where the MPI backend is asked for",
    ("collective/__init__.py", "psgd.collective.nccl"): "CuPy's NCCL loads only where a GPU is asked for",
    # `psgd --help` builds every command's parser, so it loads psgd.job and psgd.launcher: what only a command's
    # run needs stays out of it (numpy.random, the shard's core and the worker's exchange, 35 modules)
    ("job.py", "psgd.data.ahead"): "keeps psgd --help quick: numpy.random loads for a job that augments",
    ("cli/export.py", "psgd.export.shards"): "keeps psgd --help quick: the shard's checkpoints load for an export",
    ("launcher/result.py", "psgd.export.shards"): "keeps psgd --help quick: loaded once a launch has ended",
    ("launcher/result.py", "psgd.worker.client"): "keeps psgd --help quick: loaded once a launch has ended",
    ("launcher/result.py", "psgd.worker.exchange"): "keeps psgd --help quick: loaded once a launch has ended",
    ("launcher/run.py", "psgd.worker"): "keeps psgd --help quick: the worker's script, for psgd run alone",
}
#: at most this many, each with a reason
MOST_LATE_IMPORTS = 25
#: the benchmarks load what each measures only when ``psgd bench KIND`` runs it: no more of them than now
MOST_LATE_IMPORTS_IN_BENCH = 180


def test_imports_inside_functions_are_few_and_each_has_a_reason():
    """An import inside a function hides what a module depends on (and hid circles the module check missed)."""
    product = [p for p in sorted(PSGD.rglob("*.py")) if p.relative_to(PSGD).parts[0] not in ("bench", "proto")]
    found = [
        (str(path.relative_to(PSGD)), line, module) for path in product for line, module in function_level_imports(path)
    ]
    unexplained = [f"{path}:{line} {module}" for path, line, module in found if (path, module) not in LATE_IMPORTS]
    assert unexplained == [], unexplained
    assert {(path, module) for path, _, module in found} == set(LATE_IMPORTS), "a reason for an import gone"
    assert len(found) <= MOST_LATE_IMPORTS, len(found)
    inner = ast.parse("def f():\n    from psgd.job import build_job\n    def g():\n        import psgd.api\n")
    assert function_level_imports_of(inner) == [(2, "psgd.job"), (4, "psgd.api")]


def test_the_benchmarks_late_imports_do_not_grow():
    found = [
        f"{path.relative_to(PSGD)}:{line} {module}"
        for path in modules("bench")
        for line, module in function_level_imports(path)
    ]
    assert len(found) <= MOST_LATE_IMPORTS_IN_BENCH, len(found)
