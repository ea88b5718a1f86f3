"""The collectives of a DBuffer (all-gather, reduce-scatter, all-reduce, the fp8 gather, the
low-precision gradient wire) and the device seam every one of them is launched through."""
