"""A model with an embedding table on the parameter servers: a sync run is exactly one process with N times the
batch, table included; the rows move in the same pulls and pushes; what the shards refuse changes nothing."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import make_job, run_threads, shards

from psgd.config import Deadlines, Links
from psgd.errors import Code, install_extra
from psgd.job import build_job
from psgd.observe.prometheus import ShardMetrics
from psgd.ops.reach import Connect, read_status
from psgd.training.local import LocalExchange
from psgd.training.loop import run_loop
from psgd.worker.client import fetch_weights
from psgd.worker.exchange import run_worker

SMALL = (
    "model.name=embed",
    "model.dim=3",
    "model.hidden=[8]",
    "data.name=clicks",
    "data.n_train=1536",
    "data.n_test=256",
    "data.fields=5",
    "data.dense=3",
    "data.max_cardinality=2000",
)


def shard_rows(servers, table="emb"):
    """Every row the shards hold, by id."""
    out = {}
    for s in servers:
        t = s.core.tables.tables[table]
        state = t.state_dict()
        out.update(zip(state["ids"].tolist(), state["rows"]))
    return out


@pytest.mark.parametrize(
    "rule, transport, overlap",
    [("sgd", "grpc", False), ("rowwise_adagrad", "tcp", False), ("lazy_adam", "shm", False), ("sgd", "tcp", True)],
)
def test_a_sync_run_with_a_table_equals_one_process_with_n_times_the_batch(rule, transport, overlap):
    """... with [cluster] overlap too: the next step's rows are pulled beside this step's push, and under sync
    that pull waits for the round, so nothing changes."""
    workers, batch = 2, 16
    job = make_job(
        *SMALL,
        "train.dtype=float64",
        "train.epochs=1",
        f"train.batch_size={batch}",
        "optimizer.name=sgd",
        "optimizer.lr=0.1",
        f"tables.optimizer={rule}",
        "tables.lr=0.3",
        "cluster.policy=sync",
        f"cluster.workers={workers}",
        "cluster.shards=2",
        f"cluster.transport={transport}",
        f"cluster.overlap={str(overlap).lower()}",
    )
    with shards(job) as (job, servers):
        results = run_threads(
            [lambda r=r: run_worker(job, r, job.cluster.servers, progress=False) for r in range(workers)], timeout=120
        )
        plan = build_job(job).plan
        dense = fetch_weights(job.cluster.servers, plan)
        rows = shard_rows(servers)
        held = [len(s.core.tables.tables["emb"]) for s in servers]

    reference_job = job.override("train.batch_size", workers * batch)
    reference = build_job(reference_job, check=True)
    local = LocalExchange(reference)
    expected = run_loop(reference, local, progress=False)

    assert all(r.steps == expected.steps for r in results) and min(held) > 0  # rows on both shards
    if overlap:  # every step but the first computed on weights and rows pulled beside the push before it
        assert [r.summary["pulls_ahead"] for r in results] == [expected.steps - 1] * workers
    for name in dense:
        np.testing.assert_allclose(dense[name], expected.params[name], rtol=1e-9, atol=1e-12, err_msg=name)
    want = local.tables["emb"].state_dict()
    assert sorted(rows) == sorted(want["ids"].tolist())  # the same rows made, each on its shard
    got = np.stack([rows[i] for i in want["ids"].tolist()])
    np.testing.assert_allclose(got, want["rows"], rtol=1e-9, atol=1e-12)
    start = reference.row_tables()["emb"]
    assert not np.allclose(got, start.peek(want["ids"]))  # training moved the rows


@pytest.mark.parametrize("overlap", [False, True])
def test_async_workers_train_a_table_and_rows_stay_on_their_shards(overlap):
    job = make_job(
        *SMALL,
        "train.epochs=3",
        "train.batch_size=32",
        "train.eval_every=20",
        "tables.lr=0.1",
        "cluster.policy=async",
        "cluster.workers=2",
        "cluster.shards=2",
        f"cluster.overlap={str(overlap).lower()}",
    )
    with shards(job) as (job, servers):
        results = run_threads(
            [lambda r=r: run_worker(job, r, job.cluster.servers, progress=False) for r in range(2)], timeout=120
        )
        plan = build_job(job).plan
        for k, s in enumerate(servers):
            ids = s.core.tables.tables["emb"].state_dict()["ids"]
            assert ids.size and (plan.shard_of_ids("emb", ids) == k).all()
        status = servers[0].core.status()
        made = sum(len(s.core.tables.tables["emb"]) for s in servers)
        seen = read_status(job.cluster.servers[0], Connect(timeout=5))["counters"]["tables"]["emb"]
        from prometheus_client import CollectorRegistry, generate_latest

        registry = CollectorRegistry()
        ShardMetrics(servers[0].core, registry)
        scraped = generate_latest(registry).decode()
    assert seen["rows"] == status["tables"]["emb"]["rows"] > 0 and seen["bytes"] > 0  # psgd status's, over gRPC
    assert f'psgd_shard_table_rows{{shard="0",table="emb"}} {float(seen["rows"])}' in scraped
    trained = np.unique(build_job(job).dataset.ids_train).size
    assert made == trained  # rank 0's evaluations read the test set's rows without making them
    history = results[0].history
    assert len(history) >= 3 and history[-1]["test_accuracy"] > 0.6  # chance is 0.5
    assert status["tables"]["emb"]["rows_updated"] > 0 and status["tables"]["emb"]["rows"] > 0


# -- hostile rows on the wire -------------------------------------------------------------------------------------
def test_hostile_rows_on_the_wire_are_refused_with_every_row_unchanged():
    import grpc

    from psgd.proto import ps_pb2, ps_pb2_grpc
    from psgd.wire.rows import MAX_ROWS

    job = make_job(*SMALL, "train.dtype=float64", "cluster.policy=async", "cluster.workers=1", "cluster.shards=1")
    with shards(job) as (job, servers):
        core = servers[0].core
        plan = build_job(job).plan
        core.register(0, plan.hash)
        ids = np.arange(5, dtype=np.int64)
        core.read_rows(0, {"emb": ids})
        before = core.read_rows(None, {"emb": ids})["emb"].copy()
        dense = [
            ps_pb2.PushMessage(chunk=ps_pb2.TensorChunk(slice_id=s.id, offset=0, data=np.zeros(s.size).tobytes()))
            for s in plan.slices_for_shard(0)
        ]
        good = np.ones((5, 3)).tobytes()
        bad_blocks = {
            "ids not whole int64s": ps_pb2.RowBlock(table="emb", ids=b"\x01\x02\x03", values=b""),
            "values of another size": ps_pb2.RowBlock(table="emb", ids=ids.tobytes(), values=good[:-8]),
            "an unknown table": ps_pb2.RowBlock(table="users", ids=ids.tobytes(), values=good),
            "an id twice": ps_pb2.RowBlock(table="emb", ids=np.array([1, 1, 2, 3, 4]).tobytes(), values=good),
            "NaN rows": ps_pb2.RowBlock(table="emb", ids=ids.tobytes(), values=np.full((5, 3), np.nan).tobytes()),
            "float32 values": ps_pb2.RowBlock(
                table="emb", ids=ids.tobytes(), values=np.ones((5, 3), np.float32).tobytes()
            ),
            "too many ids": ps_pb2.RowBlock(table="emb", ids=np.zeros(MAX_ROWS + 1, np.int64).tobytes(), values=b""),
        }
        with grpc.insecure_channel(
            job.cluster.servers[0], options=[("grpc.max_send_message_length", 1 << 26)]
        ) as channel:
            stub = ps_pb2_grpc.ParameterServerStub(channel)
            for what, block in bad_blocks.items():
                messages = [
                    ps_pb2.PushMessage(
                        header=ps_pb2.PushHeader(  # saying the rows it sends, as a worker does
                            worker_id=0,
                            clock=0,
                            base_version=0,
                            dtype="float64",
                            rows=len(block.ids) // 8,
                            registration=core.roster.workers[0].key,
                        )
                    ),
                    *dense,
                    ps_pb2.PushMessage(rows=block),
                ]
                with pytest.raises(grpc.RpcError) as info:
                    stub.Push(iter(messages), timeout=10)
                assert info.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED), (
                    what,
                    info.value.details(),
                )
                if what in ("ids not whole int64s", "an unknown table", "an id twice", "too many ids"):
                    with pytest.raises(grpc.RpcError) as info:  # asked for in a pull, the same
                        list(
                            stub.Pull(
                                ps_pb2.PullRequest(
                                    worker_id=-1, clock=0, rows=[ps_pb2.RowBlock(table=block.table, ids=block.ids)]
                                ),
                                timeout=10,
                            )
                        )
                    assert info.value.code() == (
                        grpc.StatusCode.RESOURCE_EXHAUSTED
                        if what == "too many ids"
                        else grpc.StatusCode.INVALID_ARGUMENT
                    ), (what, info.value.details())
            pulled = list(
                stub.Pull(
                    ps_pb2.PullRequest(worker_id=-1, clock=0, rows=[ps_pb2.RowBlock(table="emb", ids=ids.tobytes())]),
                    timeout=10,
                )
            )
        assert core.version == 0 and core.counters["pushes"] == 0
        np.testing.assert_array_equal(core.read_rows(None, {"emb": ids})["emb"], before)
        rows = [c.rows for c in pulled if c.HasField("rows")]
        assert np.array_equal(np.frombuffer(rows[0].ids, "<i8"), ids)
        np.testing.assert_array_equal(np.frombuffer(rows[0].values).reshape(5, 3), before)


def test_hostile_rows_on_the_data_port_are_refused_with_every_row_unchanged():
    """The same refusals over the data port, where rows are sections after a pull's header or a push's gradient:
    each with its status code, the weights and rows unchanged; a stream whose rows do not add up is closed."""
    import struct

    from psgd.link import LinkError
    from psgd.link.tcp import DataConnection
    from psgd.wire import protocol
    from psgd.wire.rows import MAX_ROWS, SECTION, sections

    job = make_job(
        *SMALL,
        "train.dtype=float64",
        "cluster.policy=async",
        "cluster.workers=1",
        "cluster.shards=1",
        "cluster.transport=tcp",
    )
    with shards(job) as (job, servers):
        core, port = servers[0].core, servers[0].data.port
        plan = build_job(job).plan
        core.register(0, plan.hash)
        ids = np.arange(5, dtype=np.int64)
        core.read_rows(0, {"emb": ids})
        before = core.read_rows(None, {"emb": ids})["emb"].copy()
        dense = np.zeros(core.flat.size).tobytes()

        def section(table: str, count: int, tail: bytes) -> bytes:
            return SECTION.pack(len(table.encode()), count) + table.encode() + tail

        good = np.ones((5, 3)).tobytes()
        pushes = {  # what follows the gradient: the rows' bytes, then the sections
            "an unknown table": section("users", 5, ids.tobytes() + good),
            "an id twice": section("emb", 5, np.array([1, 1, 2, 3, 4]).tobytes() + good),
            "NaN rows": section("emb", 5, ids.tobytes() + np.full((5, 3), np.nan).tobytes()),
            "float32 values": section("emb", 5, ids.tobytes() + np.ones((5, 3), np.float32).tobytes()),
            "more rows than its bytes": section("emb", 50, ids.tobytes() + good),
            "too many rows": section("emb", MAX_ROWS + 1, b""),
            "a name of no bytes": SECTION.pack(0, 5) + ids.tobytes() + good,
            "a torn header": b"\x03\x00",
        }
        for what, rows in [*pushes.items(), ("rows of an absurd length", None)]:
            conn = DataConnection("127.0.0.1", port, 0, plan.hash, timeout=10, key=core.roster.workers[0].key)
            try:  # the length of the rows, then the rows (the absurd length: refused before any is read)
                after = (
                    [protocol.ROWS_LENGTH.pack(len(rows)), rows] if rows is not None else [struct.pack("<Q", 1 << 62)]
                )
                conn._send(protocol.OP_PUSH_ROWS, 0, 0, 0, 0, [dense, *after], len(dense))
                with pytest.raises(LinkError) as info:
                    conn._reply()
                assert info.value.code == Code.INVALID_ARGUMENT, (what, info.value)
            finally:
                conn.close()
        too_many = section("emb", MAX_ROWS + 1, b"")  # refused on its header, before the ids it declares come
        for what, asked in {
            "an unknown table": {"users": ids},
            "an id twice": {"emb": np.array([1, 1])},
            "too many ids": too_many,
        }.items():
            conn = DataConnection("127.0.0.1", port, 0, plan.hash, timeout=10, key=core.roster.workers[0].key)
            try:
                payload, n = (
                    sections({t: (i, None) for t, i in asked.items()})
                    if isinstance(asked, dict)
                    else ([asked], len(asked) + (MAX_ROWS + 1) * 8)
                )
                conn._send(protocol.OP_PULL_ROWS, 0, 0, 0, 0, payload, n)
                with pytest.raises(LinkError) as info:
                    conn._reply()
                assert info.value.code == Code.INVALID_ARGUMENT, (what, info.value)
            finally:
                conn.close()
        conn = DataConnection("127.0.0.1", port, -1, plan.hash, timeout=10)  # an observer reads them unchanged
        try:
            out = np.empty((5, 3))
            conn.pull(0, [memoryview(np.empty(core.flat.size)).cast("B")], {"emb": (ids, out)})
        finally:
            conn.close()
        assert core.version == 0 and core.counters["pushes"] == 0
        np.testing.assert_array_equal(out, before)
        np.testing.assert_array_equal(core.read_rows(None, {"emb": ids})["emb"], before)


@pytest.mark.slow
def test_psgd_launch_trains_embed_on_clicks_as_a_user_runs_it(tmp_path):
    """The command the README gives, smaller: two shards, two workers, the final accuracy read with the shards'
    rows (an observer's), near what the teacher allows."""
    import json
    import os
    import shutil
    import subprocess

    from psgd.data.clicks import Generator, reachable_accuracy

    argv = [
        shutil.which("psgd") or "psgd",
        "launch",
        "--model",
        "embed",
        "--dataset",
        "clicks",
        "--set",
        "data.n_train=30000",
        "--set",
        "data.n_test=3000",
        "--epochs",
        "1",
        "--batch-size",
        "64",
        "--set",
        "tables.lr=0.1",
        "--no-progress",
        "--json",
        "--save",
        "model.npz",
    ]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    reach = reachable_accuracy(Generator(0).make("test", 0, 3000, 3000))
    assert reach - 0.06 < result["test_accuracy"] <= reach + 0.02, (result["test_accuracy"], reach)
    with np.load(tmp_path / "model.npz", allow_pickle=False) as saved:  # the table's rows saved with the weights
        ids, rows = saved["table:emb:ids"], saved["table:emb:rows"]
        assert ids.size > 1000 and (np.diff(ids) > 0).all() and rows.shape[0] == ids.size
        assert np.isfinite(rows).all()


def test_the_shards_and_their_checkpoints_export_the_tables_and_psgd_eval_scores_them(tmp_path):
    from psgd.export.shards import join_checkpoints, pull_from_servers
    from psgd.launcher.result import evaluate_weights as _evaluate
    from psgd.model.table import table_keys
    from psgd.server.durable import recovery
    from psgd.server.state import checkpoint
    from psgd.training.evaluation import evaluate_file
    from psgd.weights import save_weights
    from psgd.worker.client import PSClient

    job = make_job(
        *SMALL,
        "train.epochs=1",
        "train.batch_size=32",
        "tables.lr=0.1",
        "cluster.policy=sync",
        "cluster.workers=2",
        "cluster.shards=2",
    )
    with shards(job) as (job, servers):
        run_threads(
            [lambda r=r: run_worker(job, r, job.cluster.servers, progress=False) for r in range(2)], timeout=120
        )
        for s in servers:  # what psgd-server writes on its way out
            recovery.write(s.core, checkpoint.shard_dir(tmp_path, s.core.shard, s.core.fingerprint), force=True)
        live = pull_from_servers(job)
        with PSClient(job.cluster.servers, build_job(job).plan) as reader:
            _, live_scores, _ = _evaluate(job, live.weights, "ps", reader)
        held = shard_rows(servers)
    assert live.notes == []  # nothing moved while the rows were listed
    joined = join_checkpoints(job, tmp_path)
    ids_key, rows_key = table_keys("emb")
    for exported in (joined, live):  # the checkpoints' rows, and the running shards' listed page by page
        assert exported.weights[ids_key].tolist() == sorted(held)
        np.testing.assert_array_equal(exported.weights[rows_key], np.stack([held[i] for i in sorted(held)]))
    save_weights(tmp_path / "w.npz", joined.weights)
    scored = evaluate_file(job, tmp_path / "w.npz")
    assert scored["test_accuracy"] == live_scores["test_accuracy"]  # the same weights and rows, read from the file
    without = {k: v for k, v in joined.weights.items() if not k.startswith("table:")}
    save_weights(tmp_path / "dense.npz", without)
    with pytest.raises(ValueError, match="no rows of table emb"):
        evaluate_file(job, tmp_path / "dense.npz")


@pytest.mark.parametrize("transport", ["grpc", "tcp", "shm"])
@pytest.mark.parametrize("wire", ["bfloat16", "float16"])
def test_row_gradients_travel_as_16_bit_values_and_are_applied_as_the_shard_widens_them(wire, transport):
    from psgd.wire.codec import codec_for
    from psgd.worker.client import PSClient

    job = make_job(
        *SMALL,
        "cluster.policy=async",
        "cluster.workers=1",
        "cluster.shards=2",
        "tables.optimizer=sgd",
        "tables.lr=1.0",
        f"cluster.wire_dtype={wire}",
        f"cluster.transport={transport}",
    )
    plan = build_job(job).plan
    ids = np.arange(40, dtype=np.int64) * 1009
    grads = np.random.default_rng(0).normal(size=(40, 3)).astype(np.float32) * 1e-2
    with (
        shards(job) as (job, servers),
        PSClient(job.cluster.servers, plan, 0, links=Links(transport=transport, wire_dtype=wire), config=job) as client,
    ):
        client.wait_ready(30)
        client.register()
        dense = {s.name: np.zeros(s.shape, s.dtype) for s in plan.specs}
        before = np.empty((40, 3), np.float32)
        client.pull(0, {s.name: np.empty(s.shape, s.dtype) for s in plan.specs}, {"emb": (ids, before)})
        client.push(0, dense, rows={"emb": (ids, grads)})
        after = np.empty((40, 3), np.float32)
        client.pull(1, {s.name: np.empty(s.shape, s.dtype) for s in plan.specs}, {"emb": (ids, after)})
        carried = [getattr(link, "via", "tcp" if getattr(link, "data_port", 0) else "grpc") for link in client.links]
        assert carried == [transport] * 2
        pushed = sum(s.core.counters["pushes"] for s in servers)
    widened = np.empty(grads.size, np.float32)
    codec = codec_for(wire)
    packed = np.empty(grads.size, np.uint16)
    codec.encode(grads.reshape(-1), packed)
    codec.decode(packed, widened)
    assert pushed == 2 and not np.array_equal(widened, grads.reshape(-1))  # 16 bits lose some of each value
    np.testing.assert_array_equal(after, before - widened.reshape(40, 3))  # tables.lr = 1, one worker


def test_a_listing_goes_page_by_page_through_every_row_and_refuses_what_is_not_a_table():
    from psgd.link import LinkError
    from psgd.model.table import TableSpec
    from psgd.tables.held import RowTable, TableOptions
    from psgd.tables.rules import RowSGD

    t = RowTable(TableSpec("e", 2), 0, RowSGD(0.1), TableOptions(idle_updates=1))
    t.read(np.arange(3000, dtype=np.int64) * 7)
    t.apply(np.arange(0, 3000, 2, dtype=np.int64) * 7, np.ones((1500, 2)))
    t.evict_idle()  # holes in the slots
    seen, start, pages = [], 0, 0
    while start != -1 and pages < 100:
        ids, rows, start = t.page(start, 400)
        assert ids.size <= 400
        seen += ids.tolist()
        pages += 1
    assert sorted(seen) == t.held_ids().tolist() and pages == -(-len(t) // 400)

    job = make_job(*SMALL, "cluster.policy=async", "cluster.workers=1", "cluster.shards=1")
    with shards(job) as (job, servers):
        from psgd.worker.client import PSClient
        from psgd.worker.lookups import list_rows

        with PSClient(
            job.cluster.servers, build_job(job).plan, deadlines=Deadlines(request_timeout=5), retry_deadline=1
        ) as reader:
            with pytest.raises(LinkError) as info:
                reader.links[0].list_rows("users", 0)
            assert info.value.code == Code.INVALID_ARGUMENT and "'users'" in str(info.value)
            with pytest.raises(LinkError) as info:
                reader.links[0].list_rows("emb", -5)
            assert info.value.code == Code.INVALID_ARGUMENT
            ids, values, spans = list_rows(reader, "emb")  # no row made yet: an empty table
        assert ids.size == 0 and values.shape == (0, 3) and spans == [(0, 0)]
        assert len(servers[0].core.tables.tables["emb"]) == 0


@pytest.mark.lacks(
    __import__("importlib").util.find_spec("mpi4py") is None,
    reason=f"the mpi extra is not installed ({install_extra('mpi')})",
)
def test_allreduce_ranks_holding_the_whole_table_equal_one_process_with_n_times_the_batch(tmp_path):
    import subprocess
    import sys

    from psgd.config import to_toml
    from psgd.launcher import find_mpiexec

    ranks, batch = 2, 16
    job = make_job(
        *SMALL,
        "train.dtype=float64",
        "train.epochs=1",
        f"train.batch_size={batch}",
        "optimizer.name=sgd",
        "optimizer.lr=0.1",
        "tables.optimizer=rowwise_adagrad",
        "tables.lr=0.3",
        f"cluster.workers={ranks}",
    )
    path = tmp_path / "job.toml"
    path.write_text(to_toml(job.to_dict()))
    saved = tmp_path / "w.npz"
    done = subprocess.run(
        [
            find_mpiexec(),
            "-n",
            str(ranks),
            sys.executable,
            "-m",
            "psgd.cli.worker",
            "-c",
            str(path),
            "--mode",
            "allreduce",
            "--backend",
            "mpi",
            "--no-progress",
            "--json",
            "--save",
            str(saved),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lead = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    with np.load(saved, allow_pickle=False) as f:
        allreduce = {k: f[k] for k in f.files}

    reference_job = job.override("train.batch_size", ranks * batch)
    reference = build_job(reference_job, check=True)
    expected = run_loop(reference, LocalExchange(reference), progress=False)
    assert sorted(allreduce) == sorted(expected.params)  # the dense weights, and the table's rows saved with them
    for name, ref in expected.params.items():
        np.testing.assert_allclose(allreduce[name], ref, rtol=1e-9, atol=1e-12, err_msg=name)
    assert any(abs(r.get("test_accuracy", -1) - expected.test_accuracy) < 1e-12 for r in lead), lead


def test_a_pull_or_push_of_rows_is_given_time_for_its_rows_bytes_too(monkeypatch):
    """The watchdog that cuts off a stalled transfer allows a transfer the time its bytes take at the least rate
    (psgd.server.net.datapath.MIN_TRANSFER_RATE): the rows' bytes count, not only the dense weights'."""
    from psgd.server.net import datapath
    from psgd.worker.client import PSClient

    monkeypatch.setattr(datapath, "MIN_TRANSFER_RATE", 1e5)  # 100 kB/s: seconds a few MB of rows are given
    job = make_job(
        *SMALL,
        "model.dim=64",
        "train.dtype=float64",
        "cluster.policy=async",
        "cluster.workers=1",
        "cluster.shards=1",
        "cluster.transport=grpc",
    )
    with shards(job) as (job, servers):
        armed = []
        watchdog = servers[0].servicer.watchdog
        real = watchdog.watch
        monkeypatch.setattr(watchdog, "watch", lambda seconds, *a, **k: armed.append(seconds) or real(seconds, *a, **k))
        plan = build_job(job).plan
        ids = np.arange(8000, dtype=np.int64)  # 8000 rows of 64 float64: 4.1 MB, 41 s at the least rate
        with PSClient(job.cluster.servers, plan, 0, deadlines=Deadlines(request_timeout=60), config=job) as client:
            client.register()
            out = np.empty((8000, 64))
            client.pull(0, {s.name: np.empty(s.shape, s.dtype) for s in plan.specs}, {"emb": (ids, out)})
            pulled = armed[-1]  # re-armed once the pull may go (it waits without a deadline before)
            armed.clear()
            client.push(0, {s.name: np.zeros(s.shape, s.dtype) for s in plan.specs}, rows={"emb": (ids, out * 0)})
            pushed = max(a for a in armed if a != float("inf"))
    dense = datapath.transfer_seconds(servers[0].core.nbytes, 60)
    assert dense < 10 < 40 < pulled <= 60 and 40 < pushed <= 60, (dense, pulled, pushed)
