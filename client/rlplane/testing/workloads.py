"""Reference workloads (DESIGN.md): the batches benchmarks, demos and e2e tests move.

``vlm_step``: B samples of S tokens, lengths uniform in [S/4, S]; per sample 0, 1 or 2
images, each a ``[h*w, 1176]`` float32 pixel_values segment with h, w uniform in
[16, 52] and an ``image_grid_thw`` row ``(1, h, w)`` per image. ``text_step``: the text
fields only. ``small_step``: a B=8 text batch for per-operation latency.

Example::

    batch = vlm_step(batch=8, seqlen=256, seed=0)
    batch.fields["pixel_values"]   # PackedTensor with some None rows
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rlplane.packed import PackedTensor

PATCH_DIM = 1176


@dataclass
class Workload:
    """A generated batch: ``fields`` for put_samples and each sample's ``lengths``."""

    name: str
    fields: dict[str, Any]
    lengths: torch.Tensor

    @property
    def batch(self) -> int:
        return int(self.lengths.numel())

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors as written (before any wire cast or cut)."""
        return fields_nbytes(self.fields)

    def select(self, indices: list[int]) -> Workload:
        """The samples at ``indices``, in that order (a new batch; packed rows keep their boundaries).

        Example::

            first_half = vlm_step(batch=8).select(list(range(4)))
        """
        fields: dict[str, Any] = {}
        for k, v in self.fields.items():
            if isinstance(v, (PackedTensor, torch.Tensor)):
                fields[k] = v.select(indices) if isinstance(v, PackedTensor) else v[indices]
            else:
                fields[k] = [v[i] for i in indices]
        return Workload(self.name, fields, self.lengths[indices])


def fields_nbytes(fields: dict[str, Any]) -> int:
    """Bytes of the tensors in a fields dict (packed rows and jagged values included, objects not)."""
    total = 0
    for v in fields.values():
        if isinstance(v, PackedTensor):
            total += v.nbytes
        elif isinstance(v, torch.Tensor):
            t = v.values() if v.is_nested else v
            total += t.numel() * t.element_size()
    return total

def text_step(batch: int = 256, seqlen: int = 4096, seed: int = 0) -> Workload:
    """The text fields of a GRPO step (ids, lengths, masks, logprobs, advantages)."""
    g = torch.Generator().manual_seed(seed)
    lo = max(1, seqlen // 4)
    lengths = torch.randint(lo, seqlen + 1, (batch,), generator=g, dtype=torch.int64)
    pos = torch.arange(seqlen)
    valid = pos < lengths[:, None]
    fields: dict[str, Any] = {
        "input_ids": torch.randint(0, 151_000, (batch, seqlen), generator=g, dtype=torch.int64) * valid,
        "input_lengths": lengths.clone(),
        "token_mask": (valid & (pos >= lo // 2)).to(torch.float32),
        "sample_mask": torch.ones(batch, dtype=torch.float32),
        "generation_logprobs": -torch.rand(batch, seqlen, generator=g) * valid,
        "advantages": torch.randn(batch, seqlen, generator=g) * valid,
    }
    return Workload("text-step", fields, lengths)


def vlm_step(batch: int = 64, seqlen: int = 2048, seed: int = 0, max_images: int = 2,
             sides: tuple[int, int] = (16, 52)) -> Workload:
    """The reference "vlm-step" batch (about 190 MB stored at B=64, S=2048). ``sides``: the
    least and most patches along an image's height and width (smaller for a demo)."""
    w = text_step(batch, seqlen, seed)
    g = torch.Generator().manual_seed(seed + 1)
    n_images = torch.randint(0, max_images + 1, (batch,), generator=g).tolist()
    pixel_rows: list[Any] = []
    grid_rows: list[Any] = []
    mm = torch.zeros(batch, seqlen, dtype=torch.int64)
    for i, n in enumerate(n_images):
        if n == 0:
            pixel_rows.append(None)
            grid_rows.append(None)
            continue
        hw = torch.randint(sides[0], sides[1] + 1, (n, 2), generator=g)
        pixel_rows.append([torch.randn(int(h * ww), PATCH_DIM, generator=g) for h, ww in hw.tolist()])
        grid_rows.append(torch.cat([torch.ones(n, 1, dtype=torch.int64), hw], dim=1))
        image_tokens = min(int(w.lengths[i]) // 2, 64 * n)
        mm[i, 1 : 1 + image_tokens] = 1
    w.fields["mm_token_type_ids"] = mm
    w.fields["pixel_values"] = PackedTensor(pixel_rows)
    w.fields["image_grid_thw"] = PackedTensor(grid_rows)
    w.name = "vlm-step"
    return w


def vlm_grpo(batch: int = 64, seqlen: int = 2048, seed: int = 0, group: int = 8,
             sides: tuple[int, int] = (16, 52), copies: bool = True) -> Workload:
    """"vlm-grpo": the vlm-step batch as groups of ``group`` samples (B/group prompts with G
    answers each) sharing each group's images: every member's ``pixel_values`` and
    ``image_grid_thw`` rows are equal copies (separate tensors, same bytes) of its group's
    first member's, as a rollout that processed each sample's prompt on its own would hand over.
    ``copies=False``: the very same tensors instead, as a rollout that repeats each prompt's
    processed images for its answers hands over (workload "vlm-grpo-same")."""
    w = vlm_step(batch, seqlen, seed, sides=sides)
    for name in ("pixel_values", "image_grid_thw"):
        rows = w.fields[name].rows
        w.fields[name] = PackedTensor([None if rows[i - i % group] is None else
                                       [t.clone() if copies else t for t in rows[i - i % group]] for i in range(batch)])
    w.name = "vlm-grpo" if copies else "vlm-grpo-same"
    return w


def vlm_grpo_same(batch: int = 64, seqlen: int = 2048, seed: int = 0, group: int = 8) -> Workload:
    """"vlm-grpo-same": :func:`vlm_grpo` whose members hold their group's very image tensors."""
    return vlm_grpo(batch, seqlen, seed, group, copies=False)


def small_step(batch: int = 8, seqlen: int = 512, seed: int = 0) -> Workload:
    """A small text batch (B=8): per-operation latency, where fixed costs dominate bytes."""
    w = text_step(batch, seqlen, seed)
    w.name = "small"
    return w


def text_scale(batch: int = 4096, seqlen: int = 1024, seed: int = 0) -> Workload:
    """"text-scale": the text fields at S=1024 for a sweep over B (64 .. 8192): the cost
    per sample must stay flat as B grows."""
    return text_step(batch, seqlen, seed)


WORKLOADS = {"vlm-step": vlm_step, "vlm-grpo": vlm_grpo, "vlm-grpo-same": vlm_grpo_same, "text-step": text_step, "small": small_step, "text-scale": text_scale}
