"""The first step of a floating-point op="avg": every input scaled by 1/n before the sum, as NCCL's
pre-multiplied sum. Array-module generic (numpy on the host, CuPy on the GPU compute the same
bits), so the host collectives and pyrdma.cuda share it without importing each other."""


def scale_down(xp, values, n):
    """values /= n in place: the first step of a floating-point avg, as NCCL's pre-multiplied sum
    (``xp`` is numpy or CuPy, which compute the same bits). float32 and float64 round to nearest.
    float16, whose range is tight, goes through float32 and is rounded toward zero: n scaled
    values near 65504 then cannot sum past it for n < 10 (to nearest, three 65504s give
    3 x 21840 = 65520 -> inf); only inputs within a few units in the last place of the maximum,
    over 10 or more ranks, can still overflow in the summation's own rounding. The float32 quotient
    of a float16 by n < 4096 is never a float16 unless exact, so one step back is the truncation."""
    dt = values.dtype
    if dt == xp.float16:
        q = values.astype(xp.float32) / xp.float32(n)
        r = q.astype(xp.float16)
        bits = r.view(xp.uint16)
        over = xp.abs(r.astype(xp.float32)) > xp.abs(q)           # rounded away from zero: step back
        values[...] = xp.where(over, bits - xp.uint16(1), bits).view(xp.float16)
    elif dt == xp.float32 or dt == xp.float64:
        values /= dt.type(n)
    else:
        raise TypeError(f"scale_down of {dt}")


def scale_down_bfloat16(xp, bits16, n):
    """scale_down of bfloat16 values held as their uint16 bits: through float32, to nearest even."""
    f = (bits16.astype(xp.uint32) << 16).view(xp.float32) / xp.float32(n)
    b = f.view(xp.uint32)
    rounded = ((b + xp.uint32(0x7FFF) + ((b >> 16) & xp.uint32(1))) >> 16).astype(xp.uint16)
    bits16[...] = xp.where(xp.isnan(f), (b >> 16).astype(xp.uint16) | xp.uint16(0x40), rounded)   # NaN stays NaN
