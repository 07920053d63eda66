"""The expert-FFN activation registry: name -> how h is made from x's products.

An expert FFN is `h @ W_down`, where h comes from the rows' products with
the expert's weights. A *gated* activation makes h from two products,
`h = f(gate, up)` with gate = x @ W_gate and up = x @ W_up (SwiGLU, GeGLU,
GPT-OSS's clamped GLU); a *non-gated* one from one, `h = f(x @ W_up)` (the
ReLU FFNs of Switch Transformer and NLLB-MoE, Nemotron-H's squared ReLU),
and such a config has no `w_gate` parameter at all.

Every function computes in float32 on float32 inputs. `MoEConfig.activation`
names an entry; `MoEConfig.swiglu_limit`, when set, clamps the products of
every gated activation before `f` (gate <= L, -L <= up <= L). The other
options an entry lists in `reads` must be set in the config (and those no
entry reads must stay None): `MoEConfig` checks both.

Adding an activation (the extension point): `register(Activation(...))`
before building the config that names it. Backends then compute it between
their grouped GEMMs (`moe_core.Backend`'s template); a kernel epilogue only
fuses the names it lists (EPILOGUE_ACTIVATIONS of its ops module).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp

# The options an activation may read, each a float | None field of MoEConfig.
OPTIONS = ("swiglu_alpha", "gate_softcap", "up_softcap")


@dataclasses.dataclass(frozen=True)
class Settings:
  """The config fields an activation reads (`from_config`), hashable.

  Attributes:
    name: the registry name.
    swiglu_limit: None, or L > 0: gated activations first clamp gate to
      (-inf, L] and up to [-L, L].
    swiglu_alpha, gate_softcap, up_softcap: `OPTIONS`, None unless the
      activation reads them.
  """

  name: str
  swiglu_limit: float | None = None
  swiglu_alpha: float | None = None
  gate_softcap: float | None = None
  up_softcap: float | None = None

  @classmethod
  def from_config(cls, cfg) -> Settings:
    """The activation settings of a `MoEConfig`."""
    return cls(
        name=cfg.activation,
        swiglu_limit=cfg.swiglu_limit,
        **{name: getattr(cfg, name) for name in OPTIONS},
    )

  @property
  def activation(self) -> Activation:
    return get(self.name)


@dataclasses.dataclass(frozen=True)
class Activation:
  """One registry entry.

  Attributes:
    name: what `MoEConfig.activation` says.
    gated: True: fn(gate, up, settings) -> h, two products (w_gate and
      w_up); False: fn(x, settings) -> h, of one product (w_up, no w_gate).
    fn: the elementwise function, on float32 [M, F] arrays.
    reads: the `OPTIONS` fn reads from its `Settings` (each must be set).
    doc: the formula, for error messages and docs.
  """

  name: str
  gated: bool
  fn: Callable[..., jax.Array]
  reads: tuple[str, ...] = ()
  doc: str = ""


_REGISTRY: dict[str, Activation] = {}


def register(activation: Activation) -> None:
  """Adds `activation` to the registry; ValueError if its name is taken or
  it reads an option `OPTIONS` does not list."""
  if not isinstance(activation, Activation):
    raise TypeError(
        f"register takes an activations.Activation, got {type(activation)}."
    )
  if activation.name in _REGISTRY:
    raise ValueError(f"activation {activation.name!r} is already registered.")
  unknown = sorted(set(activation.reads) - set(OPTIONS))
  if unknown:
    raise ValueError(
        f"activation {activation.name!r} reads {unknown}, which are not "
        f"MoEConfig activation options {OPTIONS}."
    )
  _REGISTRY[activation.name] = activation


def names() -> tuple[str, ...]:
  """Every registered activation name, in registration order."""
  return tuple(_REGISTRY)


def get(name: str) -> Activation:
  """The entry called `name`; ValueError naming the registered ones."""
  try:
    return _REGISTRY[name]
  except (KeyError, TypeError):
    raise ValueError(
        f"activation must be one of {names()}, got {name!r}."
    ) from None


def hidden(
    settings: Settings, gate: jax.Array | None, up: jax.Array
) -> jax.Array:
  """h of one expert FFN, float32 [M, F], from float32 products [M, F].

  gate is None for a non-gated activation. The clamp of `swiglu_limit`
  comes first, as GLM-5, DeepSeek-V4 and GPT-OSS apply it.
  """
  act = settings.activation
  if not act.gated:
    return act.fn(up, settings)
  limit = settings.swiglu_limit
  if limit is not None:
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
  return act.fn(gate, up, settings)


def _plain_glu(function):
  """function(gate) * up, as a gated entry's fn."""

  def fn(gate, up, settings):
    del settings
    return function(gate) * up

  return fn


def _gpt_oss_glu(gate, up, settings):
  # GPT-OSS: (up + 1) * gate * sigmoid(alpha * gate); the +1 keeps a path
  # for up near 0.
  alpha = settings.swiglu_alpha
  return (up + 1.0) * gate * jax.nn.sigmoid(alpha * gate)


def _softcap(z, cap):
  return cap * jnp.tanh(z / cap)


def _softcapped_silu(gate, up, settings):
  # Inkling 2: the sigmoid sees the raw gate; only the linear factors are
  # soft-capped.
  return (
      _softcap(gate, settings.gate_softcap)
      * jax.nn.sigmoid(gate)
      * _softcap(up, settings.up_softcap)
  )


def _relu2(x, settings):
  del settings
  return jnp.square(jax.nn.relu(x))


def _relu(x, settings):
  del settings
  return jax.nn.relu(x)


# Hugging Face's "gelu" is the exact erf form; "gelu_pytorch_tanh" the tanh
# approximation.
for _entry in (
    Activation("silu", True, _plain_glu(jax.nn.silu), doc="silu(g) * u"),
    Activation(
        "gelu",
        True,
        _plain_glu(functools.partial(jax.nn.gelu, approximate=False)),
        doc="gelu(g) * u (erf)",
    ),
    Activation(
        "gelu_tanh",
        True,
        _plain_glu(functools.partial(jax.nn.gelu, approximate=True)),
        doc="gelu_tanh(g) * u",
    ),
    Activation(
        "gpt_oss_glu",
        True,
        _gpt_oss_glu,
        reads=("swiglu_alpha",),
        doc="(u + 1) * g * sigmoid(swiglu_alpha * g)",
    ),
    Activation(
        "softcapped_silu",
        True,
        _softcapped_silu,
        reads=("gate_softcap", "up_softcap"),
        doc="cg * tanh(g / cg) * sigmoid(g) * cu * tanh(u / cu)",
    ),
    Activation("relu", False, _relu, doc="relu(x W1)"),
    Activation("relu2", False, _relu2, doc="relu(x W1)^2"),
):
  register(_entry)
