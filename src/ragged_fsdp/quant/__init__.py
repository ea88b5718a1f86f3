"""Block-wise quantisation for the all-gather and the gradient reduction (pure math; the
collectives are in ``ragged_fsdp.fsdp.comms.quant_gather`` and ``ragged_fsdp.fsdp.comms.wire_reduce``)."""
from .bnb4 import BnB4Weight, load_bnb4_state_dict, pad_bnb4_blobs
from .blockfp8 import (
    FP8_DTYPES, BlockFP8, TileGeometry, dequantize_pieces, per_tensor_quantize_dequantize,
    quantize_dequantize, quantize_pieces, tile_amax,
)
from .grad_wire import GradientReduce
from .mxfp8 import MXFP8
from .nvfp4 import NVFP4
from .scale_layout import ScaleLayout
from .state_dict import dequantized_state_dict

__all__ = ["BlockFP8", "MXFP8", "NVFP4", "GradientReduce", "TileGeometry", "ScaleLayout", "quantize_pieces", "dequantize_pieces",
           "quantize_dequantize", "per_tensor_quantize_dequantize", "tile_amax", "FP8_DTYPES",
           "dequantized_state_dict", "BnB4Weight", "load_bnb4_state_dict", "pad_bnb4_blobs"]
