// The candidate formats of a data-format search (Lee, Park, Jeon, ICLR 2022, §2.1): fixed point,
// floats with gradual underflow, float-fix hybrids and a log format, all written as per-binade
// lists (binades:M0,M1,..., mantissa bits per binade from the top down).
//
// The rules (the paper does not state its constraints; these are ours):
//  * A b-bit format has a sign bit and 2^(b-1) magnitude codes, one of them zero: the list's
//    non-zero magnitudes, sum over i of 2^M_i, use exactly 2^(b-1) - 1 codes (no code unused).
//  * The list has the shape  p (a times), p-1 (c times), p-2, p-3, ..., 0  with a >= 1, c >= 1:
//    a plateau of p mantissa bits, then a step of p-1 bits, then a fixed-point tail of gradual
//    underflow down to 0 bits. With the budget, 2a + c + 1 = 2^(b-p), so c is odd and a runs
//    over 1 .. (2^(b-p) - 2) / 2. c = 1 is a float 1-e-m with gradual underflow (a = 2^e - 1,
//    m = p; a = 1 is fixed point); c > 1 is a float-fix hybrid. p = 0 is the log format: 2^(b-1)-1
//    binades of 0 bits (the powers of two).
//  * At most kernels::kMaxBinades (127) binades.
// Counts: 121 for 8 bits, 58 for 7, 27 for 6 (206 in all; the paper ranks 498 under rules it
// does not give, e.g. formats that leave codes unused or lists of other shapes).
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "cpd/status.h"

namespace cpd {

struct BinadeCandidate {
  std::string spec;        // canonical spec, e.g. "binades:4x7,3,2,1,0"
  int bits = 0;            // with the sign bit
  std::string family;      // BinadeFamily(mbits)
  std::string name;        // "fixed8", "fp134", "log8"; a hybrid's list, "5,4x5,3,2,1,0"
  std::vector<int> mbits;  // mantissa bits per binade, from the top down
};

// Every candidate of `bits` (2..16), ordered by p, the plateau's bits, descending, then by a,
// its length, ascending: fixed point first, the log format last. InvalidArgument outside 2..16.
Result<std::vector<BinadeCandidate>> EnumerateBinadeCandidates(int bits);

// The candidates of every width in `widths`, a comma-separated list such as "8,7,6", in the
// list's order. InvalidArgument naming the first entry that is not a whole number (e.g. "8x")
// or outside 2..16, or for an empty list.
Result<std::vector<BinadeCandidate>> EnumerateBinadeCandidates(std::string_view widths);

// "fixed" (p, p-1, ..., 0), "float" (p repeated, then p-1, ..., 0), "hybrid" (p repeated, p-1
// repeated, then p-2, ..., 0), "log" (all 0) or "binades" (any other list).
std::string BinadeFamily(const std::vector<int>& mbits);

}  // namespace cpd
