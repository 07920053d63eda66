"""The `interpret` option of the kernel backends, one meaning in all of them.

pallas, mosaic_gpu, triton and mosaic_tpu each run their kernels either
compiled for their platform (a GPU; a TPU for mosaic_tpu) or in an
interpreter that runs on any platform, and their `interpret` option reads
the same in each (docs/backends.md, "The kernel backends' `interpret`", has
the table): None is auto, compiled when the program is lowered for that
platform (one here, or `moe_core.aot`'s target from any host), decided when
the program is traced; True the interpreter; False compiled, unavailable
elsewhere; and a backend's own interpreter settings where it has them. A
backend describes its interpreter once as an `Interpreter`;
`Interpreter.parse` checks an option and keeps it as a setting (None for
auto, False, or what the kernels take to interpret), and
`Interpreter.resolve` / `interprets` turn auto into one or the other for
the program being traced.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar

from moe_core.kernels import gpu

AUTO = None  # The setting of interpret=None: decided at trace time.


def interprets(setting, compiled_for: str = "gpu") -> bool:
  """Whether the kernels of `setting` (an `Interpreter.parse` result) run
  in the interpreter in the program being traced: auto decides by
  `gpu.lowering_platform()`, compiled where it is `compiled_for` (the
  platform the backend's kernels lower for: "gpu", or "tpu" for
  mosaic_tpu)."""
  if setting is AUTO:
    return gpu.lowering_platform() != compiled_for
  return setting is not False


def _interpret_everywhere() -> Any:
  return True


@dataclasses.dataclass(frozen=True)
class Interpreter:
  """How one backend's `interpret` option names its interpreter.

  Attributes:
    default: () -> the setting its kernels take to interpret, which True
      (and auto, off its platform) selects: True for a `pallas_call`'s HLO
      interpreter, an `InterpretGPUParams` for Mosaic GPU's.
    names: the strings the option also takes, each with () -> its
      setting: pallas' ("debug", ...).
    params: the interpreter settings objects the option takes as they are,
      as (class name, how errors name it: "a pltpu.InterpretParams"):
      matched by name, so that the module defining the class is imported
      only where it is used.
    compiled_for: the platform the kernels compile for ("gpu"; "tpu" for
      mosaic_tpu): auto interprets on every other.
  """

  default: Callable[[], Any] = _interpret_everywhere
  names: tuple[tuple[str, Callable[[], Any]], ...] = ()
  params: tuple[tuple[str, str], ...] = ()
  compiled_for: str = "gpu"

  def allowed(self) -> str:
    """The values the option takes, for errors."""
    values = ["None (auto)", "True", "False"]
    values += [repr(name) for name, _ in self.names]
    values += [text for _, text in self.params]
    return ", ".join(values[:-1]) + " or " + values[-1]

  def parse(self, interpret) -> Any:
    """The setting of the option `interpret`: AUTO, False or the
    interpreter's (`default()` for True).

    Raises:
      ValueError: a string the backend does not take.
      TypeError: any other value that is not one of `allowed()`.
    """
    if interpret is None:
      return AUTO
    if interpret is False:
      return False
    if interpret is True:
      return self.default()
    if isinstance(interpret, str):
      for name, setting in self.names:
        if interpret == name:
          return setting()
      raise ValueError(
          f"interpret must be {self.allowed()}, got {interpret!r}."
      )
    if type(interpret).__name__ in dict(self.params):
      return interpret
    raise TypeError(
        f"interpret must be {self.allowed()}, got {interpret!r} "
        f"({type(interpret).__name__})."
    )

  def resolve(self, setting) -> Any:
    """`setting` for the program being traced: auto made False (lowered
    for a GPU) or `default()` (not)."""
    if setting is not AUTO:
      return setting
    return self.default() if interprets(AUTO, self.compiled_for) else False


class InterpretedLaunch:
  """A kernel backend's launch settings with an `interpret` setting (an
  `Interpreter.parse` result): what the kernels traced now take.

  A mixin for the backends' frozen `Launch` dataclasses, which name their
  backend's `Interpreter` as the class attribute `interpreter`.
  """

  interpreter: ClassVar[Interpreter]  # And a field `interpret`.

  @property
  def interpreting(self) -> bool:
    """Whether the kernels traced now run interpreted."""
    return interprets(self.interpret, self.interpreter.compiled_for)

  @property
  def kernel_interpret(self) -> Any:
    """The kernels' `interpret` for the program traced now: auto resolved."""
    return self.interpreter.resolve(self.interpret)
