"""Model FLOPs utilisation: the accelerators' peak bfloat16 FLOP/s, by kind.

MFU = tokens/s x model FLOPs per token / (devices x peak FLOP/s per device),
with the model FLOPs of `sizing.flops_per_token(...)["train"]` (forward and
backward, 3x the forward; recomputation under remat not counted, as in the
PaLM paper's definition) and the peak of dense bfloat16 matmuls, whatever
the run computes in.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Peak:
  """One accelerator's dense bfloat16 peak.

  Attributes:
    name: the accelerator, as its maker names it ("TPU v5e").
    flops_per_chip: dense bfloat16 FLOP/s of one chip (no sparsity).
    devices_per_chip: the JAX devices one chip shows (2 on TPU7x, one per
      TensorCore; 1 elsewhere, v5p's megacore included).
  """

  name: str
  flops_per_chip: float
  devices_per_chip: int = 1

  @property
  def flops_per_device(self) -> float:
    return self.flops_per_chip / self.devices_per_chip


# TPUs by the exact `device_kind` JAX reports (jax/_src/tpu_info.py,
# `chip_version_from_device_kind`: a v5e says "TPU v5 lite", a v5p
# "TPU v5"), compared without case or spacing. Figures: Google Cloud's
# pages of each TPU version, per chip.
_TPU_KINDS: dict[str, Peak] = {}
for _kinds, _peak in (
    (("TPU v5 lite", "TPU v5e"), Peak("TPU v5e", 197e12)),
    (("TPU v5", "TPU v5p"), Peak("TPU v5p", 459e12)),
    (("TPU v6 lite", "TPU v6e"), Peak("TPU v6e", 918e12)),
    (("TPU7x",), Peak("TPU7x", 2307e12, devices_per_chip=2)),
):
  for _kind in _kinds:
    _TPU_KINDS[_kind.replace(" ", "").lower()] = _peak

# NVIDIA GPUs by a fragment of their kind ("NVIDIA H100 80GB HBM3"), longer
# fragments first. Dense BF16 of the SXM parts (NVIDIA's datasheets; the
# H200 is the H100's chip with more memory): a PCIe H100 (756e12) is
# over-counted by this table, so its MFU reads low.
_GPU_FRAGMENTS: tuple[tuple[str, Peak], ...] = (
    ("H100", Peak("NVIDIA H100", 989e12)),
    ("H200", Peak("NVIDIA H200", 989e12)),
    ("B200", Peak("NVIDIA B200", 2250e12)),
)


def peak_of(device_kind: str) -> Peak | None:
  """The peak of a device by its `jax.Device.device_kind`, or None when
  unknown (a CPU, an accelerator not in the tables)."""
  kind = str(device_kind or "")
  peak = _TPU_KINDS.get(kind.replace(" ", "").lower())
  if peak is not None:
    return peak
  if "GB200" in kind.upper():  # Not a B200: its own figures, not here.
    return None
  for fragment, peak in _GPU_FRAGMENTS:
    if fragment in kind.upper():
      return peak
  return None


def mfu(
    tokens_per_s: float,
    flops_per_token: float,
    devices: int,
    peak: Peak,
) -> float:
  """The fraction of `devices` x `peak` that `tokens_per_s` tokens of
  `flops_per_token` model FLOPs each make."""
  return tokens_per_s * flops_per_token / (devices * peak.flops_per_device)


def describe(
    device_kind: str, peak: Peak | None, flops_per_token: float
) -> str:
  """The run's one line about MFU: against what, or why it is not shown."""
  if peak is None:
    return (
        f"MFU: not reported: no peak bf16 FLOP/s known for device kind "
        f"{device_kind!r} (mfu.py lists the known ones)"
    )
  return (
      f"MFU: model FLOPs {flops_per_token:.4g} per token (forward + "
      f"backward, recomputation not counted) against {peak.name}'s "
      f"{peak.flops_per_device / 1e12:,.1f} TFLOP/s bf16 peak per device"
  )
