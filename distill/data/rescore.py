"""``distill data validate --rescore N``: how faithful is the stored teacher to the model that will serve it?

N random rows are run through the model (transformers, one forward per row, in the
dtype the engine would serve these data in by default, or ``--rescore-dtype``), and at
every generated position the stored top-k is compared with the model's own next-token
distribution.

Terms
-----
top-1 agreement
    the stored rank-1 candidate is the model's argmax.
top-k set agreement
    the stored k candidate ids are exactly the model's k most likely ids (as sets).
logprob error
    ``|stored logprob - the model's logprob|`` of every stored candidate; reported as the
    median, p99 and max over all candidates. The storage quantization alone is < 0.0005 nats.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from distill.data.dataset import Dataset
from distill.errors import ConfigError, ModelError
from distill.store.teacher import decode_row_dense

#: Fidelity a dataset should reach against the served model (the project's targets).
TOPK_SET_TARGET = 0.99
P99_TARGET = 0.02  # nats


@dataclass
class RescoreReport:
    rows: int
    positions: int
    k: int
    model: str
    device: str
    dtype: str  # the dtype the model re-scored in
    teacher_dtype: str | None  # the dtype the data was generated in (None: not recorded)
    top1_agreement: float
    topk_set_agreement: float
    logprob_error_median: float
    logprob_error_p99: float
    logprob_error_max: float

    @property
    def meets_targets(self) -> bool:
        return self.topk_set_agreement >= TOPK_SET_TARGET and self.logprob_error_p99 <= P99_TARGET

    def to_dict(self) -> dict:
        return dict(asdict(self), meets_targets=self.meets_targets)

    def lines(self) -> list[str]:
        verdict = "meets" if self.meets_targets else "MISSES"
        return [
            f"rescore: {self.rows} rows, {self.positions:,} generated positions, k={self.k}; model {self.model} on {self.device} "
            f"in {self.dtype} (data generated in {self.teacher_dtype or 'an unrecorded dtype'})",
            f"  top-1 agreement {self.top1_agreement:.2%}, top-{self.k} set agreement {self.topk_set_agreement:.2%}, "
            f"|Δ logprob| median {self.logprob_error_median:.4f} / p99 {self.logprob_error_p99:.4f} / max "
            f"{self.logprob_error_max:.4f} nats",
            f"  {verdict} the fidelity targets (top-k set >= {TOPK_SET_TARGET:.0%}, p99 <= {P99_TARGET} nats)",
        ]


def sample_rows(ds: Dataset, n: int, seed: int) -> list[dict]:
    """``n`` rows drawn uniformly without replacement (ids first, then only those rows are read)."""
    ids = [r["id"] for r in ds.iter_rows(columns=["id"])]
    if not ids:
        raise ConfigError(f"{ds.root} has no rows to re-score")
    rng = np.random.default_rng(seed)
    chosen = set(rng.choice(len(ids), size=min(n, len(ids)), replace=False).tolist())
    wanted = {ids[i] for i in chosen}
    cols = ["id", "input_ids", "loss_mask", "teacher_ids", "teacher_lp"]
    return [r for r in ds.iter_rows(columns=cols) if r["id"] in wanted]


def rescore(root: Path | str, n: int, model: str | None = None, dtype: str = "auto", device: str = "auto",
            seed: int = 0) -> RescoreReport:
    """Re-score ``n`` random rows of the dataset at ``root`` with the model (see the module docstring)."""
    import torch
    from transformers import AutoModelForCausalLM

    from distill.models import resolve_model
    from distill.runtime import dataset_dtype, stage_dtype

    if n < 1:
        raise ConfigError(f"--rescore takes a number of rows >= 1; got {n}")
    ds = Dataset.open(root)
    enc = ds.encoding
    if enc is None:
        raise ConfigError(f"{root} has no teacher top-k (made from seed text): nothing to re-score")
    recorded = ds.meta.get("model") or {}
    name = model or recorded.get("id")
    if not name:
        raise ConfigError(f"{root} records no model; pass --model")
    try:
        resolved = resolve_model(name)
    except ModelError as exc:
        raise ModelError(f"cannot load {name!r} to re-score ({exc}); pass --model with a local folder") from None
    if model is None and recorded.get("revision") and resolved.revision != recorded["revision"]:
        raise ConfigError(f"{name!r} here has revision {resolved.revision} but {root} was made with {recorded['revision']}: "
                          "pass the right --model")
    teacher = dataset_dtype(ds.meta)
    where = stage_dtype(resolved.path, device, dtype, teacher, what=f"the data in {root}", warn=lambda msg: None)
    lm = AutoModelForCausalLM.from_pretrained(resolved.path, dtype=where.torch_dtype()).to(where.device).eval()
    k = enc.k
    top1 = same_set = positions = 0
    errors: list[np.ndarray] = []
    for row in sample_rows(ds, n, seed):
        t_ids, t_lp = decode_row_dense(row["input_ids"], row["loss_mask"], row["teacher_ids"], row["teacher_lp"], enc)
        pos = np.flatnonzero(row["loss_mask"])  # (N,) generated positions
        if not pos.size:
            continue
        ids = torch.tensor(row["input_ids"], device=where.device)[None]  # (1, T)
        with torch.inference_mode():
            logits = lm(ids).logits[0, torch.as_tensor(pos - 1, device=where.device)]  # (N, V): predicts each token
            ref = torch.log_softmax(logits.float(), -1)  # (N, V)
            ref_top = ref.topk(k, -1).indices.cpu().numpy()  # (N, K)
            ref = ref.cpu().numpy()
        cand, stored = t_ids[pos], t_lp[pos]  # (N, K)
        top1 += int((cand[:, 0] == ref_top[:, 0]).sum())
        same_set += int((np.sort(cand, 1) == np.sort(ref_top, 1)).all(1).sum())
        errors.append(np.abs(np.take_along_axis(ref, cand, 1) - stored).ravel())
        positions += pos.size
    if not positions:
        raise ConfigError(f"the sampled rows of {root} hold no generated token")
    err = np.concatenate(errors)
    return RescoreReport(
        rows=min(n, ds.rows), positions=positions, k=k, model=resolved.model_id, device=where.device, dtype=where.dtype,
        teacher_dtype=teacher, top1_agreement=top1 / positions, topk_set_agreement=same_set / positions,
        logprob_error_median=float(np.median(err)), logprob_error_p99=float(np.quantile(err, 0.99)),
        logprob_error_max=float(err.max()),
    )
