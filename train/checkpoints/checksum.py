"""Checksums of (sharded) arrays that do not depend on the sharding.

Orbax's tensorstore arrays carry no checksum, so `checkpoint.py`
records one per leaf at save time and compares it after restoring, onto
whatever mesh: the value depends on a leaf's dtype, shape and bits only,
not on how it is split over devices or processes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_UINT_OF_WIDTH = {8: np.uint8, 16: np.uint16, 32: np.uint32}
# Element p (row-major) is weighted by p * _STEP + 1 (mod 2**32), odd as
# _STEP is even: odd numbers are invertible modulo 2**32, so changing any
# one element always changes the sum, and the weights differ between
# positions, so swapped elements show too.
_STEP = np.uint32((2 * 0x9E3779B9) % 2**32)


def _device_words(x: jax.Array) -> jax.Array:
  """The bits of `x` as uint32 words: x's shape, plus a trailing dim of 2
  for 64-bit and complex dtypes."""
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    x = jnp.stack([x.real, x.imag], axis=-1)
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  width = x.dtype.itemsize * 8
  if width == 64:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)
  unsigned = jax.lax.bitcast_convert_type(x, _UINT_OF_WIDTH[width])
  return unsigned.astype(jnp.uint32)


def _device_checksum(x: jax.Array) -> jax.Array:
  """A uint32 scalar: sum of words * odd(position), modulo 2**32.

  Integer addition modulo 2**32 is associative and commutative, so XLA may
  add the shards' partial sums in any order, on any mesh, and the result is
  the same number. Row-major positions come from one iota per dimension
  rather than from flattening, which would gather a sharded array.
  """
  words = _device_words(x)
  position = jnp.zeros(words.shape, jnp.uint32)
  stride = 1
  for dim in reversed(range(words.ndim)):
    iota = jax.lax.broadcasted_iota(jnp.uint32, words.shape, dim)
    position = position + iota * np.uint32(stride % 2**32)
    stride *= words.shape[dim]
  multiplier = position * _STEP + np.uint32(1)
  return jnp.sum(words * multiplier, dtype=jnp.uint32)


@jax.jit
def _device_checksums(leaves: tuple) -> jax.Array:
  return jnp.stack([_device_checksum(x) for x in leaves])


def _host_checksum(x: np.ndarray) -> int:
  """`_device_checksum` of a host array, in numpy (64-bit dtypes too)."""
  x = np.asarray(x)
  if np.iscomplexobj(x):
    x = np.stack([x.real, x.imag], axis=-1)
  if x.dtype == np.bool_:
    words = x.astype(np.uint32)
  elif x.dtype.itemsize == 8:
    words = np.ascontiguousarray(x).view(np.uint32)
  else:
    unsigned = np.ascontiguousarray(x).view(_UINT_OF_WIDTH[x.itemsize * 8])
    words = unsigned.astype(np.uint32)
  position = np.arange(words.size, dtype=np.uint32)
  multiplier = position * _STEP + np.uint32(1)
  return int(np.sum(words.reshape(-1) * multiplier, dtype=np.uint32))


def checksums(leaves: list) -> list[int]:
  """One uint32 checksum per leaf (jax or numpy arrays), as Python ints.

  jax.Arrays are summed on the devices that hold them, in one jitted call
  per set of devices, and read back in one device_get of a few replicated
  scalars; host arrays in numpy, by the same formula. The value depends on
  the leaf's dtype, shape and bits only: not on its sharding, nor on the
  number of processes.
  """
  result: list[int | None] = [None] * len(leaves)
  groups: dict[tuple[int, ...], list[int]] = {}
  for i, leaf in enumerate(leaves):
    if isinstance(leaf, jax.Array):
      devices = tuple(sorted(d.id for d in leaf.sharding.device_set))
      groups.setdefault(devices, []).append(i)
    else:
      result[i] = _host_checksum(leaf)
  sums = jax.device_get(
      [
          _device_checksums(tuple(leaves[i] for i in members))
          for members in groups.values()
      ]
  )
  for members, group_sums in zip(groups.values(), sums):
    for i, s in zip(members, group_sums):
      result[i] = int(s)
  return result


def of_bytes(data: bytes) -> int:
  """The checksum of a byte string (uint8 elements), as a Python int.

  The same formula as the leaves': checkpoint metadata is covered by it.
  """
  return _host_checksum(np.frombuffer(data, np.uint8))
