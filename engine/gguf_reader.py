"""gguf-py's ``GGUFReader`` with its header parsed without a ``np.memmap`` slice per value.

Why: the reader takes every value of the header, each string of a vocabulary twice (length, bytes), as a slice of
its ``np.memmap``; numpy's memmap subclass makes each slice and view cost ~5 us more than a plain array's. Llama 3's
128k tokens and the merges are ~700k slices: 6.3 s on an AVX2 EPYC, 3.6 s for SmolLM2's 49k-token vocabulary, paid
at a GGUF's first start and by every comparison with transformers. The same slices taken from a plain ndarray view
of the same mapping give the same fields and tensors (same parts, dtypes and values; ``tests/test_gguf_reader.py``),
4-5x sooner. Only ``_get`` changes; ``data`` is still the memmap, ``data.filename`` included.
"""

from __future__ import annotations

import sys
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from gguf import GGUFReader

_NATIVE = "<" if sys.byteorder == "little" else ">"


class FastGGUFReader(GGUFReader):
    def _get(self, offset: int, dtype: npt.DTypeLike, count: int = 1,
             override_order: None | Literal["I", "S", "<"] = None) -> npt.NDArray[Any]:
        plain = self.__dict__.get("_plain")
        if plain is None:  # the first call comes from GGUFReader.__init__, right after it maps the file
            plain = self._plain = self.data.view(np.ndarray)
        dtype = np.dtype(dtype)
        count = int(count)
        arr = plain[offset : offset + dtype.itemsize * count].view(dtype)[:count]
        order = self.byte_order if override_order is None else override_order
        if order == "I" or order == _NATIVE:
            return arr  # what newbyteorder would give: the same dtype
        return arr.view(arr.dtype.newbyteorder(order))
