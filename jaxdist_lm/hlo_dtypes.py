"""Bytes per element of each HLO element type, by HLO's name for it (``pred`` is a
bool). compiled.py sizes a program's buffers and collectives with it; the book's
package reads the same table (``jaxdist_lessons.hlo``). Standard library only."""

BYTES: dict[str, int] = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "f8e4m3": 1,
    "f8e4m3fnuz": 1,
    "f8e5m2fnuz": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}
