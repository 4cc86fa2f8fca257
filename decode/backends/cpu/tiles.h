// The tile driver every product shares (the fp32 panels' and the quantized ones'): a tile computes a few rows
// against a few panels of outputs in registers, `over_panels` decides which tile computes which rows and panels.
//
// Exactness: every output element of a product is one fixed sequence of operations that depends only on its own
// row, never on how many rows, tiles or threads compute it: `over_panels` only decides which tile computes which
// rows and panels, and each tile computes its rows alone.
#pragma once

#include <ATen/Parallel.h>

#include <cstdint>

#include "simd.h"

namespace polyspec {

constexpr int kTileRows = 4;  // rows per tile, every product

// How far ahead in its own panels a tile's first row tile asks for weights (into L2), beside the next tile's line at
// the same step: with only that line in flight a core keeps too few reads outstanding to stream at the bandwidth
// the memory gives. Prefetches never fault, so the last tile may ask past its weight's end.
constexpr int64_t kAheadBytes = 2048;
constexpr int64_t kLineBytes = 64;  // a cache line: what one prefetch asks for

template <int MR, int NP>
__attribute__((always_inline)) static inline void zero_tile(Vec (&acc)[MR][NP]) {  // inlined: see store_tile
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 16
    for (int j = 0; j < NP; ++j) acc[m][j] = vzero();
}

// A tile's accumulators (MR rows x NP panels of `Lanes` outputs) into y (row stride ldy), only the first `width`
// columns: a product's last panel may be padding, which must not spill into the next sibling's outputs. Inlined
// and unrolled: an accumulator read at a run-time index (or through a call) would live in memory through the tile,
// written back at every step.
template <int64_t Lanes, class V, int MR, int NP>
__attribute__((always_inline)) static inline void store_tile(const V (&acc)[MR][NP], float* y, int64_t ldy,
                                                             int64_t width) {
  alignas(64) float out[NP * Lanes];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m) {
    if (width == NP * Lanes) {
#pragma GCC unroll 16
      for (int j = 0; j < NP; ++j) store(y + m * ldy + j * Lanes, acc[m][j]);
      continue;
    }
#pragma GCC unroll 16
    for (int j = 0; j < NP; ++j) store(out + j * Lanes, acc[m][j]);
    for (int64_t j = 0; j < width; ++j) y[m * ldy + j] = out[j];
  }
}

// The last `rows` (< MR) rows, from row m, in one tile of that many rows.
template <template <int, int> class Tile, int NP, int MR, class X, class W>
__attribute__((always_inline)) static inline void rest_rows(int64_t rows, int64_t m, int64_t p, const X& x, const W& w,
                                                            float* y, int64_t ldy) {
  if constexpr (MR > 1) {
    if (rows == MR - 1) {
      Tile<MR - 1, NP>::run(m, p, x, w, y, ldy);
    } else {
      rest_rows<Tile, NP, MR - 1>(rows, m, p, x, w, y, ldy);
    }
  }
}

// All M rows against panel p and the NP - 1 after it: tiles of MR rows, then the remainder in one tile (the panels
// stay in cache across row tiles). `Tile<MR, NP>::run(row, p, x, w, y, ldy)` computes rows row .. row + MR - 1.
template <template <int, int> class Tile, int NP, int MR, class X, class W>
static inline void over_rows(int64_t M, int64_t p, const X& x, const W& w, float* y, int64_t ldy) {
  int64_t m = 0;
  for (; m + MR <= M; m += MR) Tile<MR, NP>::run(m, p, x, w, y, ldy);
  rest_rows<Tile, NP, MR>(M - m, m, p, x, w, y, ldy);
}

// Every row against each of `panels` panels in tiles of up to MR rows, threads splitting the panels NP at a time
// (the last few one by one), at least `grain` groups of NP per task.
template <template <int, int> class Tile, int NP, int MR = kTileRows, class X, class W>
static void over_panels(int64_t M, int64_t panels, int64_t grain, const X& x, const W& w, float* y, int64_t ldy) {
  at::parallel_for(0, (panels + NP - 1) / NP, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      if ((t + 1) * NP <= panels) {
        over_rows<Tile, NP, MR>(M, t * NP, x, w, y, ldy);
      } else {
        for (int64_t p = t * NP; p < panels; ++p) over_rows<Tile, 1, MR>(M, p, x, w, y, ldy);
      }
    }
  });
}

}  // namespace polyspec
