"""The collectives of a DBuffer (all-gather, reduce-scatter, all-reduce, the fp8 gather, the
low-precision gradient wire), the device seam every one of them is launched through, and the
records of the user's custom comms that both these collectives and ``core/`` read."""
