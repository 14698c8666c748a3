"""The fast GGUF header parse gives what gguf-py's reader gives: every field (parts, their dtypes and values, data
indices, types) and every tensor, for files of either byte order."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFEndian, GGUFReader, GGUFValueType, GGUFWriter

from engine.gguf_reader import FastGGUFReader


@pytest.mark.parametrize("endian", [GGUFEndian.LITTLE, GGUFEndian.BIG], ids=lambda e: e.name.lower())
def test_fields_and_tensors_equal_gguf_pys(tmp_path, endian):
    rng = np.random.default_rng(0)
    path = tmp_path / "values.gguf"
    writer = GGUFWriter(str(path), "llama", endianess=endian)
    writer.add_block_count(3)
    writer.add_float32("f32", -1.5)
    writer.add_float64("f64", 2.25)
    writer.add_int64("i64", -(2**40))
    writer.add_uint16("u16", 65000)
    writer.add_bool("flag", True)
    writer.add_string("name", "naïve — ünïcode")
    writer.add_token_list(["<s>", "", "hello", "wörld", "\n"] * 40)
    writer.add_token_scores([float(x) for x in rng.standard_normal(200).astype(np.float32)])
    writer.add_array("nested", [[1, 2], [3]])
    writer.add_array("bools", [True, False, True])
    writer.add_key_value("ints", [7, -8, 9], GGUFValueType.ARRAY, sub_type=GGUFValueType.INT32)
    writer.add_tensor("dense", rng.standard_normal((3, 40)).astype(np.float32))  # the writer swaps its bytes
    q8 = rng.integers(0, 256, size=(2, 34 * 2), dtype=np.uint8)
    writer.add_tensor("blocks", q8, raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    reference, fast = GGUFReader(str(path)), FastGGUFReader(str(path))
    assert fast.byte_order == reference.byte_order == ("S" if endian == GGUFEndian.BIG else "I")
    assert list(fast.fields) == list(reference.fields) and len(fast.fields) > 15
    for name, want in reference.fields.items():
        got = fast.fields[name]
        assert (got.offset, got.data, got.types) == (want.offset, want.data, want.types), name
        assert len(got.parts) == len(want.parts), name
        for g, w in zip(got.parts, want.parts, strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape and np.array_equal(g, w), name
        assert got.contents() == want.contents(), name
    assert fast.fields["tokenizer.ggml.tokens"].contents()[3] == "wörld"
    assert [t.name for t in fast.tensors] == ["dense", "blocks"] == [t.name for t in reference.tensors]
    for got, want in zip(fast.tensors, reference.tensors, strict=True):
        assert (got.tensor_type, got.data_offset, got.n_bytes, got.data.dtype, got.data.shape) == (
            want.tensor_type, want.data_offset, want.n_bytes, want.data.dtype, want.data.shape)
        assert np.array_equal(got.data, want.data)
    assert fast.data.filename == reference.data.filename  # the memmap stays the reader's data
