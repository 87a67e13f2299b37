"""EAGLE-3 parity: the reference trainer (SafeAILab/EAGLE ``eagle/traineagle3``) against ``distill train-heads --arch eagle3``.

    git clone https://github.com/SafeAILab/EAGLE /tmp/eagle-ref && git -C /tmp/eagle-ref checkout cb7e084   # outside the repo
    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/bench_eagle_reference.py --reference /tmp/eagle-ref \\
        --work /tmp/eagle-parity --out benchmarks/results/eagle-reference.json

Same model (the bundled SmolLM2-135M-Instruct unless --model), same data (the quickstart's split:
``--data out/quickstart/split``, trained on ``train/``, measured on ``eval/``), the same passes over the same
rows, one process on this CPU, float32. Steps, each skipped when its output is already in ``--work``
(``--retrain`` redoes the training):

distill
    ``distill train-heads --config pipelines/quickstart.yaml`` on ``split/train`` into ``WORK/distill-heads``
    (the quickstart's ``train:`` section: EAGLE-3, 2 epochs, max_len 512, batch 4, lr 3e-3, 4 warm-up steps).
reference (one run per ``--schedules`` entry)
    the reference's own drafter, loss and training-time-test loop (``cnets.Model``, imported from
    ``--reference``, never copied), driven by the loop of its ``main.py`` with its ``ds_config.json``:
    micro-batch 1, 2 micro-batches per step, AdamW (betas 0.9/0.95, weight decay 0), gradient clipping 0.5 and
    DeepSpeed's WarmupDecayLR. ``reference``: that schedule as configured (log warm-up over 12,000 steps to
    5e-5, linear decay to 0 at 800,000), which over this budget's 84 steps never passes 2.4e-5;
    ``budget``: the same optimizer with the quickstart's peak lr (3e-3) and warm-up steps (4), decaying
    linearly to 0 at the run's last step. The draft vocabulary is the reference's (the N tokens most often
    generated in the training rows, its ``scandata``) with N = the size distill's ``auto`` picks.
    The trained weights are written as distill's EAGLE-3 folder (vLLM's ``llama_eagle3`` layout, the one the
    reference's ``save_16bit_model`` writes too): ``WORK/reference-<schedule>``; the conversion is checked
    by running both implementations on one held-out row (per-depth logits).
measure
    ``distill calibrate`` on ``split/eval`` (16 nodes, max_len 512: the quickstart's ``calibrate:``) for every
    drafter: per-depth top-1/top-5/CE and the expected tokens/step of the top-1 chain and of the 16-node
    tree; with ``--bench``, ``distill bench --tree-acceptance`` on the first 8 MT-Bench first turns (64
    tokens, greedy, 16-node drafts: the quickstart's ``bench:`` without the lookup proposer) for the
    tokens/step the full tree accepts.

Adapted (only what needs CUDA or DeepSpeed, or what is written for Llama-3 or an older transformers; the
full list goes into the result's ``adaptations``): the DeepSpeed engine -> a plain torch loop with its
optimizer, clipping, accumulation and scheduler settings; fp16 -> float32, ``.cuda()``/``.to(rank)`` ->
the CPU; the Llama-3 chat-format dataset -> distill's rows (``input_ids`` and its ``loss_mask``, the tokens
the model generated); its target-model class run under transformers 5 (three shims, checked against
transformers' own Llama to float rounding before training).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
REF_SUBDIR = Path("eagle") / "traineagle3"
REF_FILES = ("cnets.py", "configs.py", "modeling_llama_kv.py", "main.py", "ds_config.json", "config.json")
LOSS_WEIGHT = 0.8  # main.py: ploss_weight = [0.8 ** i ...]


# -- the reference, loaded from where it was fetched ------------------------------------------------------------------

def reference_dir(root: Path) -> Path:
    """``--reference``: the extracted repository (holding eagle/traineagle3) or that folder itself."""
    for cand in (root / REF_SUBDIR, root):
        if (cand / "cnets.py").is_file() and (cand / "ds_config.json").is_file():
            return cand.resolve()
    raise SystemExit(f"{root} holds no eagle/traineagle3 (cnets.py, ds_config.json): extract SafeAILab/EAGLE there first")


def import_reference(code: Path):
    """cnets, configs and modeling_llama_kv from the reference folder (sys.path; nothing is copied)."""
    sys.path.insert(0, str(code))
    import cnets  # noqa: E402
    import configs  # noqa: E402
    import modeling_llama_kv  # noqa: E402

    return cnets, configs, modeling_llama_kv


def target_loader(kv, model_path: Path):
    """What ``cnets.Model`` calls as ``LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float16)``: the
    reference's own target class (modeling_llama_kv), loaded in float32 on the CPU, under transformers 5.

    The three shims, each a transformers-version matter, not a change to the model: (1) transformers 5 keeps
    ``rope_theta`` in ``rope_parameters`` (exposed as ``rope_scaling``), which the class reads as a scaling
    spec: the config is given ``rope_scaling=None`` and ``rope_theta`` back; (2) ``_tied_weights_keys`` is a
    dict in transformers 5, a list in the class; (3) transformers 5 builds the model on the meta device, so the
    class's rotary tables (buffers made in ``__init__``) are made again on the CPU after loading."""
    import transformers
    from transformers import LlamaConfig

    KV = kv.LlamaForCausalLM

    class TargetLoader:
        @staticmethod
        def from_pretrained(path, torch_dtype=None, **kw):
            conf = LlamaConfig.from_pretrained(model_path)
            rope = dict(getattr(conf, "rope_parameters", None) or {})
            if rope:
                if rope.get("rope_type", "default") != "default":
                    raise SystemExit(f"the reference's Llama class has no {rope.get('rope_type')} RoPE under transformers 5")
                conf.rope_scaling = None
                conf.rope_theta = float(rope["rope_theta"])
            if int(transformers.__version__.split(".")[0]) >= 5 and isinstance(KV._tied_weights_keys, list):
                KV._tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
            model = KV.from_pretrained(str(model_path), config=conf, dtype=torch.float32)
            for mod in model.modules():
                if type(mod) is kv.LlamaRotaryEmbedding:
                    mod.__init__(mod.dim, mod.max_position_embeddings, mod.base)
            return model

    return TargetLoader


def check_target(loader, model_path: Path, rows: list[np.ndarray], aux: list[int]) -> dict:
    """The reference's target class (through the shims) against transformers' Llama on two rows: logits and the
    three hidden states the drafter reads (max abs difference)."""
    from transformers import AutoModelForCausalLM

    ref = loader.from_pretrained(model_path).eval()
    hf = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    T = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    att = torch.zeros(len(rows), T, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, : len(r)], att[b, : len(r)] = torch.from_numpy(r), 1
    with torch.no_grad():
        o = ref(input_ids=ids, attention_mask=att)
        h = hf(input_ids=ids, attention_mask=att, output_hidden_states=True)
    keep = att.bool()
    out = {"logits_max_abs_diff": float((o.logits - h.logits)[keep].abs().max()),
           "logits_max_abs": float(h.logits[keep].abs().max())}
    for a, i in zip(o.hidden_states, aux):
        out[f"hidden_{i}_max_abs_diff"] = float((a - h.hidden_states[i])[keep].abs().max())
        out[f"hidden_{i}_max_abs"] = float(h.hidden_states[i][keep].abs().max())
    del ref, hf
    return out


def shim_model_folder(model_path: Path, folder: Path) -> Path:
    """The model folder as the reference reads it: its files linked, plus the ``model.safetensors.index.json`` its
    embedding loader looks for (it knows sharded checkpoints only; the bundled model is one file)."""
    from safetensors import safe_open

    folder.mkdir(parents=True, exist_ok=True)
    for f in model_path.iterdir():
        link = folder / f.name
        if not link.exists():
            link.symlink_to(f.resolve())
    if not (model_path / "model.safetensors.index.json").exists():
        with safe_open(str(model_path / "model.safetensors"), "pt") as f:
            names = list(f.keys())
        index = {"metadata": {}, "weight_map": {n: "model.safetensors" for n in names}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def deepspeed_lr(k: int, max_lr: float, warmup: int, total: int, min_lr: float = 0.0) -> float:
    """DeepSpeed's WarmupDecayLR (warmup_type ``log``, its default) as its engine applies it: the learning rate of
    optimizer step k = 0, 1, ... (the scheduler starts at lr 0 and steps after each optimizer step, so step k runs
    at the scheduler's iteration k - 1)."""
    it = k - 1
    if it < 0:
        return 0.0
    if it < warmup:
        gamma = math.log(it + 1) / math.log(max(2, warmup))
    else:
        gamma = max(0.0, (total - it) / max(1.0, total - warmup))
    return min_lr + (max_lr - min_lr) * gamma


# -- data ----------------------------------------------------------------------------------------------------------

def read_rows(data: Path) -> list[tuple[np.ndarray, np.ndarray]]:
    """(input_ids, loss_mask) of every row, distill's reader: the tokens the model saw and where it generated."""
    from distill.store import iter_rows

    return [(np.asarray(r["input_ids"], np.int64), np.asarray(r["loss_mask"], bool))
            for r in iter_rows(data, columns=["id", "input_ids", "loss_mask"])]


def reference_examples(rows, max_len: int, offset: int) -> tuple[list[dict], int]:
    """The reference's dataset items ({input_ids, attention_mask, loss_mask}, each (1, T)) from distill's rows.

    Its ``build_dataset_rank`` drops conversations longer than ``max_len`` (no windows), as here. Its loss at
    position t (TTT step 0) is on token t+2 and is gated by ``loss_mask[t]``; its Llama-3 offsets (the "-2" in
    main.py) put the mask's start before the reply's first token. With ``offset`` 2, ``loss_mask[t]`` is
    distill's mask at t+2: the reference trains exactly the targets distill trains (generated tokens); 0 marks
    the generated tokens themselves."""
    out, dropped = [], 0
    for ids, mask in rows:
        if len(ids) > max_len:
            dropped += 1
            continue
        lm = np.zeros_like(mask)
        lm[: len(mask) - offset] = mask[offset:]
        t = torch.from_numpy(ids)[None]
        out.append({"input_ids": t, "attention_mask": torch.ones_like(t), "loss_mask": torch.from_numpy(lm.astype(np.int64))[None]})
    return out, dropped


def collate(features: list[dict]) -> dict:
    """main.py's DataCollatorWithPadding: right-pad with zeros to the longest item."""
    n = max(f["input_ids"].shape[1] for f in features)

    def pad(t):
        return torch.cat([t, torch.zeros(t.shape[0], n - t.shape[1], dtype=t.dtype)], dim=1)

    return {k: torch.cat([pad(f[k]) for f in features]) for k in ("input_ids", "attention_mask", "loss_mask")}


def reference_vocab(cnets, rows, n: int, vocab_size: int) -> dict:
    """The reference's draft vocabulary (``Model.scandata``): the N most frequent loss-masked (generated) tokens,
    counted by its own ``process_data`` / ``merge_dicts``; d2t[i] = id_i - i, t2d a (V,) bool."""
    chunk = {"input_ids": [[ids.tolist()] for ids, _ in rows], "loss_mask": [[mask.astype(int).tolist()] for _, mask in rows]}
    counts = cnets.merge_dicts([cnets.process_data(chunk)])
    total = sum(counts.values())
    top = counts.most_common(n)
    used = sorted(k for k, _ in top)
    d2t = torch.tensor([used[i] - i for i in range(len(used))])
    t2d = torch.tensor([i in set(used) for i in range(vocab_size)])
    return {"d2t": d2t, "t2d": t2d, "coverage": sum(f for _, f in top) / total, "size": len(used)}


def distill_auto_vocab_size(train: Path, model_path: Path, vocab_size: int) -> dict:
    """The draft-vocabulary size ``--draft-vocab auto`` gives on this data (distill's own choice)."""
    from distill.train.draft_vocab import choose_draft_vocab, generated_token_counts, special_token_ids

    _, report = choose_draft_vocab(generated_token_counts(train, vocab_size), "auto", special_token_ids(model_path))
    return report.to_dict()


# -- the reference run ------------------------------------------------------------------------------------------------

def run_reference(args, schedule: str, out: Path, split: Path, model_path: Path, ref_code: Path) -> dict:
    """Train the reference drafter (its Model, loss and TTT; main.py's loop without DeepSpeed) and write it as a distill
    EAGLE-3 folder at ``out``. Returns the run's record."""
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader, DistributedSampler

    cnets, configs, kv = import_reference(ref_code)
    ds_config = json.loads((ref_code / "ds_config.json").read_text())
    target_conf = json.loads((model_path / "config.json").read_text())
    V = int(target_conf["vocab_size"])
    train_rows = read_rows(split / "train")
    if args.limit_rows:  # smoke tests only
        train_rows = train_rows[: args.limit_rows]
    auto = distill_auto_vocab_size(split / "train", model_path, V)
    # the reference's draft vocabulary (its scandata: at most the distinct generated tokens there are)
    vocab = reference_vocab(cnets, train_rows, args.draft_vocab or auto["size"], V)
    n_vocab = vocab["size"]

    # The reference's config.json, written for this target: a one-layer Llama of its width + draft_vocab_size.
    econf = configs.EConfig(
        vocab_size=V, hidden_size=target_conf["hidden_size"], intermediate_size=target_conf["intermediate_size"],
        num_hidden_layers=1, num_attention_heads=target_conf["num_attention_heads"],
        num_key_value_heads=target_conf["num_key_value_heads"], hidden_act=target_conf["hidden_act"],
        max_position_embeddings=target_conf["max_position_embeddings"], rms_norm_eps=target_conf["rms_norm_eps"],
        pad_token_id=target_conf.get("pad_token_id"), bos_token_id=target_conf.get("bos_token_id"),
        eos_token_id=target_conf.get("eos_token_id"), tie_word_embeddings=False, draft_vocab_size=n_vocab)
    rope = getattr(econf, "rope_scaling", None)  # transformers 5 gives every config a default rope_parameters
    if rope is not None:
        if rope.get("rope_type", rope.get("type")) != "default":
            raise SystemExit(f"EConfig got rope_scaling {rope}: the reference drafter would not build")
        econf.rope_scaling = None  # cnets reads any rope_scaling as a {type, factor} spec; its RoPE base is 10000 anyway

    # main.py's train_config; cnets reads it by attribute (main.py passes a dict: see the result's notes)
    train_config = SimpleNamespace(bs=ds_config["train_micro_batch_size_per_gpu"], num_epochs=args.epochs, num_workers=0,
                                   max_len=args.max_len, gradient_checkpointing=args.gradient_checkpointing)
    examples, dropped = reference_examples(train_rows, args.max_len, args.mask_offset)
    import datasets

    order = datasets.Dataset.from_dict({"i": list(range(len(examples)))}).shuffle(seed=42)["i"]  # build_dataset_rank
    examples = [examples[i] for i in order]

    cnets.LlamaForCausalLM = target_loader(kv, model_path)
    aux = [2, target_conf["num_hidden_layers"] // 2, target_conf["num_hidden_layers"] - 3]  # modeling_llama_kv's layers
    target_check = check_target(cnets.LlamaForCausalLM, model_path, [r[0] for r in train_rows[:2]], aux)
    print("reference target class vs transformers:", json.dumps(target_check), flush=True)

    set_seed(0)  # main.py, before the model is built
    shim = shim_model_folder(model_path, out.parent / "reference-model-folder")
    model = cnets.Model(econf, ds_config, train_config, path=str(shim), load_emb=True, load_head=True)
    vocab_dir = out.parent / f"{out.name}-scandata"
    vocab_dir.mkdir(parents=True, exist_ok=True)
    torch.save({"d2t": vocab["d2t"], "t2d": vocab["t2d"]}, vocab_dir / "cache.pt")
    with contextlib.chdir(vocab_dir):  # scandata reads ./cache.pt when it is there
        model.scandata(None, str(model_path))

    params = [p for p in model.parameters() if p.requires_grad]
    opt_cfg = ds_config["optimizer"]["params"]
    optimizer = torch.optim.AdamW(params, lr=0.0, betas=tuple(opt_cfg["betas"]), weight_decay=opt_cfg["weight_decay"],
                                  eps=opt_cfg.get("eps", 1e-8))
    gas, clip = ds_config["gradient_accumulation_steps"], ds_config["gradient_clipping"]
    sp = ds_config["scheduler"]["params"]
    micro_total = len(examples) * args.epochs
    total_steps = micro_total // gas
    if schedule == "reference":
        sched = dict(max_lr=sp["warmup_max_lr"], warmup=sp["warmup_num_steps"], total=sp["total_num_steps"], min_lr=sp["warmup_min_lr"])
    else:
        sched = dict(max_lr=args.budget_lr, warmup=args.budget_warmup, total=total_steps, min_lr=0.0)

    sampler = DistributedSampler(examples, num_replicas=1, rank=0, shuffle=True)
    loader = DataLoader(examples, batch_size=train_config.bs, sampler=sampler, num_workers=0, collate_fn=collate)
    metrics = out.parent / f"{out.name}-metrics.jsonl"
    log = metrics.open("w")
    step, micro, tokens, t0 = 0, 0, 0, time.monotonic()
    group = {"loss": [], "plosses": [], "acces": []}
    epochs = []
    model.train()
    optimizer.zero_grad(set_to_none=True)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch + 1)
        ep_loss, ep_acc = [], []
        for data in loader:
            if micro % gas == 0:
                lr = deepspeed_lr(step, **sched)
                for g in optimizer.param_groups:
                    g["lr"] = lr
            plosses, _vlosses, acces = model(input_ids=data["input_ids"], attention_mask=data["attention_mask"],
                                             loss_mask=data["loss_mask"])
            loss = sum(LOSS_WEIGHT ** i * plosses[i] for i in range(len(plosses)))
            (loss / gas).backward()  # DeepSpeed's engine.backward scales by 1/gradient_accumulation_steps
            micro += 1
            tokens += int(data["attention_mask"].sum())
            group["loss"].append(float(loss.detach()))
            group["plosses"].append([float(p) for p in plosses])
            group["acces"].append(list(acces))
            ep_loss.append(float(loss.detach()))
            ep_acc.append(list(acces))
            if micro % gas == 0:
                gnorm = float(torch.nn.utils.clip_grad_norm_(params, clip))
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                rec = {"step": step, "epoch": epoch, "lr": lr, "loss": float(np.mean(group["loss"])), "grad_norm": gnorm,
                       "tokens": tokens, "seconds": time.monotonic() - t0,
                       **{f"ploss_{j}": float(np.mean([p[j] for p in group["plosses"]])) for j in range(len(plosses))},
                       **{f"acc_{j}": float(np.mean([a[j] for a in group["acces"]])) for j in range(len(acces))}}
                log.write(json.dumps(rec) + "\n")
                log.flush()
                if step % args.log_every == 0 or step == total_steps:
                    print(f"{out.name} step {step}/{total_steps} lr {lr:.3g} loss {rec['loss']:.4f} "
                          f"acc_0 {rec['acc_0']:.3f} {rec['seconds']:.0f}s", flush=True)
                group = {"loss": [], "plosses": [], "acces": []}
        epochs.append({"epoch": epoch, "mean_loss": float(np.mean(ep_loss)),
                       "mean_acc": [float(np.mean([a[j] for a in ep_acc])) for j in range(len(ep_acc[0]))]})
    seconds = time.monotonic() - t0
    log.close()
    model.eval()

    write_distill_folder(model, econf, target_conf, aux, out, model_path, split, {
        "trainer": "SafeAILab/EAGLE eagle/traineagle3 (cnets.Model), converted by benchmarks/bench_eagle_reference.py",
        "schedule": schedule, "reference_commit": args.reference_commit})
    check = conversion_check(model, out, model_path, split / "eval")
    print("conversion check:", json.dumps(check), flush=True)
    last = json.loads(metrics.read_text().splitlines()[-1])
    return {
        "trainer": "reference", "schedule": schedule, "mask_offset": args.mask_offset, "folder": str(out),
        "train": {"seconds": seconds, "tokens": tokens, "steps": step, "micro_batches": micro, "tokens_per_s": tokens / seconds,
                  "final_loss": last["loss"], "final_step": last, "epochs": epochs, "rows": len(examples),
                  "rows_dropped_over_max_len": dropped, "ttt_steps": model.length,
                  "loss_definition": "sum_j 0.8^j ploss_j; ploss_j = -sum(position_mask * p_target * log p_draft) / (B*T): "
                                     "soft CE against the live target's softmax over the draft vocabulary, at positions "
                                     "whose loss_mask is set and whose target argmax is in the draft vocabulary, divided "
                                     "by ALL B*T positions (not per target); mean over the step's 2 micro-batches",
                  "lr_schedule": sched, "optimizer": {"name": "AdamW", **opt_cfg, "lr": "schedule", "gradient_clipping": clip,
                                                     "gradient_accumulation_steps": gas, "micro_batch": train_config.bs}},
        "draft_vocab": {"size": vocab["size"], "coverage_of_generated_train_tokens": vocab["coverage"],
                        "distill_auto": auto},
        "target_class_check": target_check, "conversion_check": check, "metrics": str(metrics),
        "args": {k: str(v) for k, v in vars(args).items()},
    }


def write_distill_folder(model, econf, target_conf: dict, aux: list[int], out: Path, model_path: Path, split: Path,
                         note: dict) -> None:
    """The reference drafter's weights as distill's (and vLLM's) EAGLE-3 folder: the names are the same (fc, midlayer.*,
    norm, lm_head, d2t, t2d); the embedding and the target stay out. The reference's drafter attention applies
    RoPE with base 10000 whatever the target's (cnets.LlamaRotaryEmbedding's default), so the folder's config says
    rope_theta 10000."""
    from distill.heads.eagle import DrafterConfig, EagleDrafter
    from distill.heads.vocab import DraftVocab
    from distill.models import resolve_model

    sd = {k: v.detach().float().clone() for k, v in model.state_dict().items()
          if not k.startswith(("target_model.", "embed_tokens."))}
    sd["d2t"], sd["t2d"] = model.d2t.to(torch.int64), model.t2d.to(torch.bool)
    dconf = DrafterConfig.for_target(target_conf, aux, int(sd["lm_head.weight"].shape[0]))
    base = getattr(model.midlayer.self_attn.rotary_emb, "base", 10000)
    if "rope_parameters" in dconf.arch:
        dconf.arch["rope_parameters"] = {**dconf.arch["rope_parameters"], "rope_theta": float(base), "rope_type": "default"}
    if "rope_theta" in dconf.arch:
        dconf.arch["rope_theta"] = float(base)
    if "rope_parameters" not in dconf.arch and "rope_theta" not in dconf.arch:
        dconf.arch["rope_theta"] = float(base)
    drafter = EagleDrafter(dconf, DraftVocab.from_maps(sd["d2t"], sd["t2d"]))
    own = {k for k in drafter.state_dict() if not k.startswith("rotary.")}
    missing, unexpected = sorted(own - set(sd)), sorted(set(sd) - own)
    if missing or unexpected:
        raise SystemExit(f"reference weights do not map onto the distill drafter: missing {missing}, unexpected {unexpected}")
    drafter.load_state_dict(sd, strict=False)
    resolved = resolve_model(str(model_path)) if model_path != resolve_model(None).path else resolve_model(None)
    base_model = {"id": resolved.model_id, "revision": resolved.revision, "path": str(resolved.path)}
    drafter.save(out, extra={"base_model": base_model, "dataset": {"path": str((split / "train").resolve())},
                             "teacher_dtype": "float32", "arch": "eagle3", "converted": note})


@torch.no_grad()
def conversion_check(model, folder: Path, model_path: Path, eval_data: Path) -> dict:
    """The reference Model (its own forward, logits caught at its lm_head) and the converted folder run by distill
    (:func:`distill.train.eagle.unroll`) on the first held-out row: per TTT step, the largest logit difference and
    the top-1 agreement, over the positions whose inputs both see the same (the reference pads the shifted
    token ids with id 0 at the row's end, distill with a zero embedding)."""
    from transformers import AutoModelForCausalLM

    from distill.heads.eagle import EagleDrafter
    from distill.train.eagle import step0_keep, target_features, unroll

    ids, mask = read_rows(eval_data)[0]
    x = torch.from_numpy(ids)[None]
    att = torch.ones_like(x)
    caught = []
    handle = model.lm_head.register_forward_hook(lambda m, i, o: caught.append(o.detach().float()))
    try:
        model(input_ids=x, attention_mask=att, loss_mask=torch.from_numpy(mask.astype(np.int64))[None])
    finally:
        handle.remove()
    drafter = EagleDrafter.load(folder)
    backbone = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    batch = {"input_ids": x, "attention_mask": att}
    aux, _, embeds = target_features(backbone, batch, drafter.config.aux_layer_ids)
    pos = torch.arange(x.shape[1])[None]
    outs = unroll(drafter, drafter.fuse(aux), embeds, pos, step0_keep(att), len(caught))
    per = []
    T = x.shape[1]
    for j, (ref, out) in enumerate(zip(caught, outs)):
        n = T - j - 2
        mine = drafter.logits(out)[0, :n]
        theirs = ref[0, :n]
        per.append({"step": j, "positions": n, "max_abs_diff": float((mine - theirs).abs().max()),
                    "max_abs": float(theirs.abs().max()), "top1_agree": float((mine.argmax(-1) == theirs.argmax(-1)).float().mean())})
    return {"row_tokens": T, "steps": per}


# -- distill and the measurements -------------------------------------------------------------------------------------

def cli(*argv: str, log: Path) -> float:
    """``python -m distill.cli ARGV`` in this environment; its output goes to ``log``; returns the wall seconds."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.monotonic()
    with log.open("w") as f:
        p = subprocess.run([sys.executable, "-m", "distill.cli", *argv], cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
    if p.returncode != 0:
        raise SystemExit(f"distill {argv[0]} failed ({p.returncode}): see {log}")
    return time.monotonic() - t0


def finished(folder: Path) -> bool:
    return (folder / "model.safetensors").is_file() and (folder / "distill-heads.json").is_file() and \
        not (folder / ".commit-incomplete").exists()


def run_distill(args, out: Path, split: Path) -> dict:
    if args.retrain or not finished(out):
        wall = cli("train-heads", "--config", str(REPO / "pipelines" / "quickstart.yaml"), "--data", str(split / "train"),
                   "--out", str(out), "--report-to", "none", log=out.parent / "distill-train.log")
    else:
        wall = None
    meta = json.loads((out / "distill-heads.json").read_text())
    m = meta["metrics"]
    final = m["final"]
    steps = sorted({int(k[4:].split("_")[0]) for k in final if k.startswith("step") and k[4:5].isdigit()})
    return {
        "trainer": "distill", "folder": str(out),
        "train": {"seconds": m["seconds"], "process_wall_seconds": wall, "tokens": m["tokens"], "steps": m["steps"],
                  "tokens_per_s": m["tokens_per_s"], "final_loss": final["loss"], "ttt_steps": len(steps),
                  "final_step": final, "config": meta["train_config"],
                  "loss_definition": "sum_j 0.8^j CE_j; CE_j = hard cross-entropy of the sampled token t+j+2 over the "
                                     "draft vocabulary, mean over the step's generated targets (per target)"},
        "draft_vocab": m.get("draft_vocab") or meta.get("draft_vocab"),
    }


def measure(args, folder: Path, split: Path, name: str) -> dict:
    cal = folder / "calibration.json"
    if args.retrain or not cal.is_file() or json.loads(cal.read_text()).get("nodes") != args.nodes:
        cli("calibrate", "--heads", str(folder), "--data", str(split / "eval"), "--nodes", str(args.nodes), "--max-len", "512",
            "--no-plots", "-q", log=folder.parent / f"{name}-calibrate.log")
    c = json.loads(cal.read_text())
    out = {"held_out": {"tokens": c["tokens"], "positions": c["positions"], "top1": c["top1"], "top5": c.get("top5"),
                        "ce": c.get("loss"), "chain_tokens_per_step": c.get("chain_expected_acceptance_length"),
                        f"tree{args.nodes}_tokens_per_step": c["expected_acceptance_length"]}}
    if args.bench:
        bdir = folder.parent / f"{name}-bench"
        if args.retrain or not (bdir / "bench.json").is_file():
            cli("bench", "--heads", str(folder), "--limit", "8", "--max-tokens", "64", "--modes", "greedy",
                "--draft-nodes", str(args.nodes), "--tree-acceptance", "--out", str(bdir), "-q", log=folder.parent / f"{name}-bench.log")
        b = json.loads((bdir / "bench.json").read_text())
        allg = [g for g in b["groups"] if g.get("category") == "all"]
        out["mt_bench"] = {"full_tree_tokens_per_step": b["tree"].get("full_tree_tokens_per_step"),
                           "prompts": b["config"]["limit"], "max_tokens": b["config"]["max_tokens"],
                           "draft_nodes": (b["config"].get("decoding") or {}).get("draft_nodes"), "group_all": allg[0] if allg else None}
    return out


def cpu_info() -> dict:
    from distill.runtime import machine

    info = {"machine": machine(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("Model name", "CPU family", "Model", "CPU(s)"):
                info[key.strip()] = value.strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    import transformers

    info["transformers"] = transformers.__version__
    return info


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reference", type=Path, required=True, help="where SafeAILab/EAGLE was extracted (holds eagle/traineagle3)")
    ap.add_argument("--reference-commit", default=None, help="the commit it was extracted from (recorded only)")
    ap.add_argument("--data", type=Path, default=REPO / "out" / "quickstart" / "split", help="a split folder (train/, eval/)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/eagle-parity"))
    ap.add_argument("--parts", default="distill,reference,measure", help="comma-separated: distill, reference, measure")
    ap.add_argument("--schedules", default="reference,budget", help="reference runs: reference (ds_config as is), budget")
    ap.add_argument("--epochs", type=int, default=2, help="passes over the training rows (the quickstart's)")
    ap.add_argument("--max-len", type=int, default=512, help="the reference drops longer rows (the quickstart's max_len)")
    ap.add_argument("--mask-offset", type=int, default=2, choices=(0, 2),
                    help="reference loss_mask[t] = generated[t + offset] (2: the targets distill trains; 0: the generated tokens)")
    ap.add_argument("--draft-vocab", type=int, default=0, help="reference draft vocabulary size (0: the size distill's auto picks)")
    ap.add_argument("--budget-lr", type=float, default=3e-3, help="schedule 'budget': peak lr (the quickstart's)")
    ap.add_argument("--budget-warmup", type=int, default=4, help="schedule 'budget': warm-up steps (the quickstart's)")
    ap.add_argument("--gradient-checkpointing", action="store_true", help="the reference's activation recompute (off: same math)")
    ap.add_argument("--nodes", type=int, default=16, help="calibrate's tree and bench's draft nodes (the quickstart's)")
    ap.add_argument("--bench", action="store_true", help="also distill bench --tree-acceptance on 8 MT-Bench prompts")
    ap.add_argument("--retrain", action="store_true", help="redo what is already in --work")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--run-suffix", default="", help="appended to the reference runs' names and folders (variants)")
    ap.add_argument("--limit-rows", type=int, default=0, help="reference: train on the first N rows only (smoke tests; 0: all)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "eagle-reference.json")
    args = ap.parse_args()

    from distill.models import resolve_model

    parts = set(args.parts.split(","))
    ref_code = reference_dir(args.reference)
    split = args.data.resolve()
    model_path = resolve_model(None).path
    args.work.mkdir(parents=True, exist_ok=True)
    prev = json.loads(args.out.read_text()) if args.out.is_file() else {}
    runs = dict(prev.get("runs", {}))

    if "distill" in parts:
        runs["distill"] = {**runs.get("distill", {}), **run_distill(args, args.work / "distill-heads", split)}
        print("distill:", json.dumps(runs["distill"]["train"], default=str)[:400], flush=True)
    if "reference" in parts:
        for schedule in args.schedules.split(","):
            name = f"reference-{schedule}{args.run_suffix}"
            folder = args.work / name
            if args.retrain or not finished(folder) or name not in runs:
                runs[name] = run_reference(args, schedule, folder, split, model_path, ref_code)
    if "measure" in parts:
        for name, run in runs.items():
            run.update(measure(args, Path(run["folder"]), split, name))
            print(name, json.dumps(run["held_out"]), json.dumps(run.get("mt_bench", {}).get("full_tree_tokens_per_step")), flush=True)

    train_rows = read_rows(split / "train")
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_info(),
        "reference": {"repo": "SafeAILab/EAGLE", "path": str(REF_SUBDIR), "commit": args.reference_commit,
                      "sha256_16": {f: sha(ref_code / f) for f in REF_FILES if (ref_code / f).is_file()}},
        "model": str(resolve_model(None).model_id), "data": {
            "split": str(args.data), "train_rows": len(train_rows), "train_tokens": int(sum(len(i) for i, _ in train_rows)),
            "train_generated_tokens": int(sum(m.sum() for _, m in train_rows)), "eval": str(args.data / "eval")},
        "args": {k: str(v) for k, v in vars(args).items()},  # the last invocation's (each reference run keeps its own)
        "matched": [
            "model: the bundled SmolLM2-135M-Instruct, float32, CPU, one process",
            "data: the same 84 training conversations (distill's rows: input_ids and loss_mask), every token of each; "
            "the same held-out rows for calibrate",
            "budget: --epochs (2) passes over those rows for both trainers (runs.*.train.tokens: the input tokens seen)",
            "draft vocabulary size: distill's auto size; the reference picks its own N most frequent generated tokens",
            "fused target layers (2, 15, 27), the drafter's shape (fc + one Llama layer on [embedding; feature] + norm + "
            "draft LM head), TTT positions (step j at position id t+j) and attention (step 0 causal + the own chain)",
            "loss weights 0.8^j per TTT step",
            "measurement: the same distill calibrate (and bench) on both folders",
        ],
        "not_matched": [
            "TTT steps: reference 7 (cnets.Model.length), distill 3 (quickstart default --ttt-steps)",
            "targets: reference = the live target's full softmax over the draft vocabulary (soft, temperature 1), "
            "only where its argmax is in the draft vocabulary; distill = the sampled token (--targets hard)",
            "loss normalisation: reference divides by all B*T positions; distill by the step's targets",
            "optimizer: reference AdamW betas (0.9, 0.95), wd 0, clip 0.5, micro-batch 1 x 2 accumulated (2 rows per "
            "step), DeepSpeed WarmupDecayLR (schedule 'reference': its ds_config; 'budget': peak 3e-3, 4 warm-up steps, "
            "linear decay to 0 at the run's end); distill AdamW (torch defaults: betas 0.9/0.999, wd 0), clip 1.0, "
            "batch 4 windows per step, lr 3e-3, 4 linear warm-up steps then cosine decay",
            "initialisation: reference random (nn.Linear defaults), its embedding the target's; distill starts as the "
            "target's tempered logit lens (init_from_target)",
            "the reference's draft vocabulary holds no special token unless frequent; distill adds them",
            "drafter RoPE: reference base 10000 (hard-coded in cnets), distill the target's (100000); each folder's "
            "config.json says its own, so inference uses what each trained with",
            "order: reference datasets shuffle(seed 42) + DistributedSampler(seed 0, set_epoch(epoch+1)); distill its "
            "own (shard order, no shuffle buffer at the quickstart's settings)",
            "distill's seconds include its checkpoints every 5 steps (save_every 5)",
        ],
        "adaptations": [
            "deepspeed.initialize / model_engine.backward / .step -> a plain loop: loss/2 backward per micro-batch, every "
            "2nd micro-batch clip_grad_norm_(0.5) + torch.optim.AdamW.step with DeepSpeed WarmupDecayLR's lr (log warm-up, "
            "lr 0 on the first step as the engine gives it) from ds_config.json",
            "fp16 autocast + loss scaling -> float32; .cuda()/.to(rank) -> CPU; wandb and deepspeed.comm -> metrics.jsonl",
            "model.zero_grad() at every micro-batch (harmless under DeepSpeed, whose ZeRO-2 keeps its own gradient "
            "buffers) -> zero_grad once per accumulated step",
            "build_dataset_rank (Llama-3 chat template, its offsets) -> distill's rows; loss_mask shifted by --mask-offset",
            "scandata's Llama-3 JSON scan -> its process_data/merge_dicts on distill's rows; the top-N/d2t/t2d code of "
            "scandata restated; handed to scandata through its cache.pt",
            "train_config: cnets reads .gradient_checkpointing and .max_len as attributes, main.py passes a dict (key "
            "'gradient_checkpoint'): as committed Model() would raise AttributeError; a namespace is passed, checkpointing "
            "off (a GPU memory trade)",
            "load_emb: its loader knows only sharded checkpoints (model.safetensors.index.json); the model folder is "
            "given through a folder of links plus that index",
            "EConfig under transformers 5: its default rope_parameters (alias rope_scaling) reset to None, which cnets "
            "needs to build its own RoPE (base 10000, as under transformers 4)",
            "the target class under transformers 5: rope_theta/rope_scaling, _tied_weights_keys as a dict, rotary tables "
            "rebuilt after meta-device loading (target_class_check: against transformers' Llama)",
        ],
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {args.out}")
    for name, run in runs.items():
        t, h = run.get("train", {}), run.get("held_out", {})
        print(f"{name:20s} train {t.get('seconds', 0):7.1f}s {t.get('tokens')} tok loss {t.get('final_loss')} | "
              f"top1 {[round(x, 3) for x in h.get('top1', [])]} chain {h.get('chain_tokens_per_step')} "
              f"tree{args.nodes} {h.get(f'tree{args.nodes}_tokens_per_step')} | "
              f"mt-bench {run.get('mt_bench', {}).get('full_tree_tokens_per_step')}")


if __name__ == "__main__":
    main()
