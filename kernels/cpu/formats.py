"""The panel formats of packed weights: each packed tensor's dtype names its format, and this table gives the C
kernels' code for it (``enum hp_weight_format`` in ``ops.h``)."""

from __future__ import annotations

import torch

# enum hp_weight_format (ops.h) of each packed dtype: fp32, Q4 (bytes), BF16 and Q8 (signed bytes) panels, BF16C
# panels (int16: the BF16 layout, computed in bfloat16), the byte blocks Q5 and Q6M, and the K-quant panels Q4K, Q5K
# and Q6K, and BF16A panels (BF16C 32 columns wide, for AMX); Q4A, Q6A and Q8A panels (a GGUF file's blocks for
# AMX in bfloat16) and Q4S, Q6S, Q8S (their bytes, on AMX in fp32), and Q4KS, Q6KS (Q4S's and Q6S's products, a
# K-quant's scales kept).
# The last five of the blocks are bytes viewed as
# int32, float64, uint16, uint32 and uint64 (blocks.BYTE_BLOCK_DTYPES, blocks.K_QUANT_DTYPES), BF16A's bfloat16
# pairs as float16, the widened panels as 8-bit float types, Q4KS and Q6KS as bits4x2 and bits8: dtypes that only
# name the format here.
WEIGHT_FORMATS = {torch.float32: 0, torch.uint8: 2, torch.bfloat16: 3, torch.int8: 4, torch.int16: 5, torch.int32: 6,
                  torch.float64: 8, torch.uint16: 9, torch.uint32: 10, torch.uint64: 11, torch.float16: 12,
                  torch.float8_e4m3fn: 13, torch.float8_e5m2: 14, torch.float8_e4m3fnuz: 15,
                  torch.float8_e5m2fnuz: 16, torch.float4_e2m1fn_x2: 17, torch.float8_e8m0fnu: 18, torch.bits4x2: 19,
                  torch.bits8: 20}
