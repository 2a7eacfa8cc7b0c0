"""``ctr``: click-through prediction over hashed categorical features.

A task in the library's task contract: ``configure(**options)``,
``build_model()``, ``dataset(split)``, ``extra_results()``.

The data is synthetic and deterministic (no download): a planted logistic
model over ``features`` categorical features. Each feature has its own
block of rows in one embedding table of ``rows`` rows. A feature's value is
a category rank drawn log-uniformly (a Zipf-like law: a few categories are
common, most are rare), hashed to a row of its block by a fixed permutation
(so row ids carry no order). The planted click logit is a bias plus one
weight per (feature, row); weights shrink with the category's rank, as in
real click logs where rare categories carry little signal. A label is a
Bernoulli draw of the planted probability. ``auc_ceiling`` is the planted
model's own AUC on the test split: no model does better on those labels.

The model: an ``Embedding(rows, dim)`` table (the large variable: 2 million
rows x 16 floats = 128 MB by default), flattened, and one ``Dense`` logit -
a factorised logistic regression. Compiled with Adagrad (the usual choice
for sparse features; each row gets its own step size) and an AUC metric.
"""

from __future__ import annotations

import math

import numpy as np

# Defaults: the table is 2,000,000 x 16 float32 = 128 MB.
DEFAULTS = {
    "rows": 2_000_000,
    "features": 16,
    "dim": 16,
    "train_size": 1_000_000,
    "test_size": 100_000,
    "seed": 0,
    "learning_rate": 0.5,
    # Std of the planted weight of the most common categories.
    "signal": 2.0,
}
MIN_FEATURES, MAX_FEATURES = 8, 26
# Planted weight scale of rank r: 1 / (1 + r / RANK_SCALE). The signal sits
# in the common categories, which a few hundred steps see often enough to
# learn; the rare tail only adds rows touched once or never (sparse updates).
RANK_SCALE = 5.0
# Odd multiplier of the row permutation (coprime with every block size
# that is not a multiple of it; checked).
HASH_MULTIPLIER = 1_000_003


def _int(name, value, minimum):
    try:
        out = int(str(value).replace("_", ""))
    except ValueError:
        raise ValueError(f"ctr option {name}={value!r} is not an integer; "
                         f"use e.g. {name}={DEFAULTS[name]}") from None
    if out < minimum:
        raise ValueError(f"ctr option {name}={out} must be at least {minimum}")
    return out


def _float(name, value, minimum):
    try:
        out = float(value)
    except ValueError:
        raise ValueError(f"ctr option {name}={value!r} is not a number; "
                         f"use e.g. {name}={DEFAULTS[name]}") from None
    if not out > minimum or not math.isfinite(out):
        raise ValueError(f"ctr option {name}={out} must be a finite number above {minimum}")
    return out


def auc(labels, scores) -> float:
    """Exact ROC AUC (Mann-Whitney, ties counted half)."""
    labels = np.asarray(labels).astype(bool).ravel()
    scores = np.asarray(scores, dtype=np.float64).ravel()
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores), dtype=np.float64)
    sorted_scores = scores[order]
    # Average ranks over ties.
    _, first, counts = np.unique(sorted_scores, return_index=True, return_counts=True)
    avg = first + (counts - 1) / 2.0 + 1.0
    ranks[order] = np.repeat(avg, counts)
    pos = labels.sum()
    neg = len(labels) - pos
    if pos == 0 or neg == 0:
        raise ValueError("AUC needs both classes")
    return float((ranks[labels].sum() - pos * (pos + 1) / 2.0) / (pos * neg))


class CtrTask:
    """The ctr task; ``models.ctr`` exposes one instance's methods."""

    def __init__(self):
        self.options = dict(DEFAULTS)
        self._cache: dict = {}

    def configure(self, **options) -> None:
        """``--task-option KEY=VALUE`` strings (or values) -> checked options."""
        unknown = sorted(set(options) - set(DEFAULTS))
        if unknown:
            raise ValueError(f"ctr has no option {unknown[0]!r}; options: "
                             f"{', '.join(sorted(DEFAULTS))}")
        out = dict(self.options)
        for name, value in options.items():
            if name in ("learning_rate", "signal"):
                out[name] = _float(name, value, 0.0)
            else:
                out[name] = _int(name, value, {"seed": 0, "train_size": 1,
                                               "test_size": 2}.get(name, 1))
        if not MIN_FEATURES <= out["features"] <= MAX_FEATURES:
            raise ValueError(f"ctr option features={out['features']} must be between "
                             f"{MIN_FEATURES} and {MAX_FEATURES}")
        if out["rows"] < 2 * out["features"]:
            raise ValueError(f"ctr option rows={out['rows']} must be at least 2 per feature "
                             f"({2 * out['features']} for {out['features']} features)")
        self.options = out
        self._cache = {}

    # -- the planted model -------------------------------------------------
    def _blocks(self):
        """(offset, size) of each feature's rows in the table."""
        rows, features = self.options["rows"], self.options["features"]
        base, extra = divmod(rows, features)
        sizes = [base + (1 if f < extra else 0) for f in range(features)]
        offsets = np.cumsum([0] + sizes[:-1])
        return list(zip(offsets.tolist(), sizes))

    def _planted(self):
        """Planted weights per table row, and the bias."""
        if "planted" not in self._cache:
            rng = np.random.default_rng([self.options["seed"], 1])
            weights = np.empty(self.options["rows"], dtype=np.float64)
            for offset, size in self._blocks():
                rank = np.arange(size, dtype=np.float64)
                w = rng.normal(0.0, self.options["signal"], size) / (1.0 + rank / RANK_SCALE)
                # Row of rank r: the permutation used in _examples.
                weights[offset + self._row_of(np.arange(size), size)] = w
            # A click rate near 25 %, as the logits are centred.
            self._cache["planted"] = (weights, -1.1)
        return self._cache["planted"]

    @staticmethod
    def _row_of(rank, size):
        if size % HASH_MULTIPLIER == 0:  # never for sizes below ~1e6 * features
            return rank % size
        return (rank * HASH_MULTIPLIER + 12345) % size

    def _examples(self, split):
        """(ids int32 [n, features], labels float32 [n], planted logits [n])."""
        if split not in ("train", "test"):
            raise ValueError(f"ctr split {split!r} is not 'train' or 'test'")
        if split not in self._cache:
            n = self.options[f"{split}_size"]
            rng = np.random.default_rng([self.options["seed"], 2 if split == "train" else 3])
            weights, bias = self._planted()
            blocks = self._blocks()
            ids = np.empty((n, len(blocks)), dtype=np.int64)
            for f, (offset, size) in enumerate(blocks):
                # Log-uniform rank in [0, size): P(rank < k) ~ log(k) / log(size).
                rank = np.floor(np.exp(rng.random(n) * math.log(size))).astype(np.int64) - 1
                ids[:, f] = offset + self._row_of(np.clip(rank, 0, size - 1), size)
            logits = bias + weights[ids].sum(axis=1)
            labels = (rng.random(n) < 1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
            self._cache[split] = (ids.astype(np.int32), labels, logits)
        return self._cache[split]

    # -- the contract ------------------------------------------------------
    def build_model(self):
        import keras

        o = self.options
        ids = keras.Input((o["features"],), dtype="int32", name="ids")
        x = keras.layers.Embedding(o["rows"], o["dim"], name="table")(ids)
        x = keras.layers.Flatten()(x)
        logit = keras.layers.Dense(1, name="logit")(x)
        model = keras.Model(ids, logit, name="ctr")
        model.compile(
            optimizer=keras.optimizers.Adagrad(o["learning_rate"]),
            loss=keras.losses.BinaryCrossentropy(from_logits=True),
            metrics=[keras.metrics.AUC(from_logits=True, name="auc")],
        )
        return model

    def dataset(self, split):
        import tensorflow as tf

        ids, labels, _ = self._examples(split)
        return tf.data.Dataset.from_tensor_slices((ids, labels[:, None]))

    def extra_results(self) -> dict:
        _, labels, logits = self._examples("test")
        return {"auc_ceiling": round(auc(labels, logits), 6)}


TASK = CtrTask()
configure = TASK.configure
build_model = TASK.build_model
dataset = TASK.dataset
extra_results = TASK.extra_results
