"""Training a model with an embedding table in one process: embed on clicks learns, its table holds only the
rows training touched, and what cannot train one yet says so."""

from __future__ import annotations

import numpy as np
import pytest

from psgd.config import ConfigError, JobConfig
from psgd.data import DataError, describe_dataset, load_dataset
from psgd.data.clicks import Generator, reachable_accuracy
from psgd.job import build_job
from psgd.model import ModelError
from psgd.training.local import LocalExchange
from psgd.training.loop import run_loop


def clicks_job(*sets: str) -> JobConfig:
    config = JobConfig()
    config = config.apply_sets(
        [
            "model.name=embed",
            "model.dim=8",
            "model.hidden=[16]",
            "data.name=clicks",
            "data.n_train=8000",
            "data.n_test=2000",
            "train.epochs=1",
            "train.batch_size=64",
            "tables.lr=0.1",
            *sets,
        ]
    )
    return config


def test_embed_learns_the_clicks_teacher_and_its_table_holds_only_the_rows_training_touched():
    job = build_job(clicks_job(), check=True)
    exchange = LocalExchange(job)
    result = run_loop(job, exchange, progress=False)
    reach = reachable_accuracy(Generator(0).make("test", 0, 2000, 2000))
    assert 0.5 + 0.5 * (reach - 0.5) < result.test_accuracy <= reach + 0.03, (result.test_accuracy, reach)
    table = exchange.tables["emb"]
    trained = np.unique(job.dataset.ids_train)
    assert len(table) == trained.size  # every id of training, once; the test set's own ids read, never made
    np.testing.assert_array_equal(table.held_ids(), trained)
    assert result.summary["tables"]["emb"]["rows"] == trained.size


def test_admission_keeps_rare_ids_out_of_the_table():
    job = build_job(clicks_job("tables.admit_after=3"), check=True)
    exchange = LocalExchange(job)
    run_loop(job, exchange, progress=False)
    from psgd.data import ShardedBatches

    ds, t = job.dataset, job.config.train
    batches = ShardedBatches(ds.x_train, ds.y_train, rank=0, world=1, batch_size=t.batch_size, seed=t.seed)
    sightings = np.concatenate([np.unique(ds.ids_train[idx]) for idx in batches.indices(0)])  # once a batch
    ids, counts = np.unique(sightings, return_counts=True)
    held = exchange.tables["emb"].held_ids()
    assert np.isin(ids[counts >= 3], held).all()  # in 3 batches' pulls: admitted
    assert len(held) < 0.6 * ids.size  # most ids are seen fewer times, and a sketch admits early only rarely


def test_what_cannot_train_a_table_yet_says_so_in_one_line():
    from psgd.training.loop import Exchange
    from psgd.worker.exchange import ParameterServerExchange

    class Elsewhere(Exchange):  # a mode that holds no tables
        mode = "elsewhere"

        def weights(self, step, lookups=None):
            return {}

        def exchange(self, step, grads):
            raise AssertionError("never reached")

    job = build_job(clicks_job(), check=True)
    with pytest.raises(ConfigError, match="has embedding tables, which the elsewhere mode does not train yet"):
        run_loop(job, Elsewhere(), progress=False)
    with pytest.raises(ConfigError, match="trains without the local policy so far"):
        ParameterServerExchange(build_job(clicks_job("cluster.policy=local")), None, 0)
    with pytest.raises(ModelError, match="needs a dataset with one id per categorical field"):
        build_job(clicks_job("data.name=digits"))


def test_clicks_is_a_dataset_with_ids_and_checked_options():
    shape = describe_dataset("clicks", fields=5, dense=2)
    assert (shape.input_shape, shape.num_classes, shape.id_shape) == ((2,), 2, (5,))
    ds = load_dataset("clicks", n_train=100, n_test=10, fields=5, dense=2)
    assert ds.ids_train.shape == (100, 5) and ds.id_shape == (5,) and "ids (5,)" in ds.describe()
    with pytest.raises(DataError, match="clicks: unknown option"):
        load_dataset("clicks", size=3)
    with pytest.raises(DataError, match="alpha must be a number between 1 and 3"):
        describe_dataset("clicks", alpha=0.5)


@pytest.mark.parametrize(
    "key, value, words",
    [
        ("optimizer", "adam", "optimizer must be one of sgd, rowwise_adagrad"),
        ("beta1", 1.0, "beta1 must be a finite number in [0, 1)"),
        ("lr", 0, "lr must be a finite number > 0"),
        ("when_full", "drop", 'when_full must be "fail" or "evict"'),
        ("max_rows", -2, "max_rows must be an integer"),
    ],
)
def test_the_tables_section_is_checked(key, value, words):
    config = JobConfig()
    with pytest.raises(ConfigError, match=f"\\[tables\\] {words[:20]}"):
        config = config.apply_sets([f"tables.{key}={value!r}" if isinstance(value, str) else f"tables.{key}={value}"])


def test_the_trained_tables_are_saved_with_the_weights_and_psgd_eval_scores_them_alike(tmp_path):
    from psgd.training.evaluation import evaluate_file
    from psgd.training.local import train_local
    from psgd.weights import save_weights

    config = clicks_job()
    result = train_local(config, progress=False)
    assert {"table:emb:ids", "table:emb:rows"} <= set(result.params)
    save_weights(tmp_path / "w.npz", result.params)
    assert evaluate_file(config, tmp_path / "w.npz")["test_accuracy"] == result.test_accuracy
