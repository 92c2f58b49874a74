#include "comm/allreduce/plan.h"

#include <algorithm>
#include <cmath>
#include <utility>

namespace cpd::comm::internal {
namespace {

using Range = std::pair<std::size_t, std::size_t>;  // flat [first, second)

std::size_t RoundUp(std::size_t x, std::size_t a) { return (x + a - 1) / a * a; }

// The layer that contains flat position `pos` (offsets non-decreasing, pos < total).
int LayerAt(const std::vector<std::size_t>& offsets, std::size_t pos) {
  const auto it = std::upper_bound(offsets.begin(), offsets.end(), pos);
  return int(it - offsets.begin()) - 1;
}

// bucket_mb counts MiB of float32; at least one element.
std::size_t BucketCapacity(double bucket_mb) {
  const double cap = std::floor(bucket_mb * double(1 << 20) / sizeof(float));
  return cap >= 1.0 ? std::size_t(std::min(cap, 1e18)) : 1;
}

// Consecutive layers are fused while they fit; a layer larger than a bucket is cut into equal
// parts at multiples of kPlanAlign from its start. Empty layers belong to no bucket.
std::vector<Range> BucketRanges(const GradientLayout& layout, std::size_t cap) {
  std::vector<Range> ranges;
  Range open{0, 0};
  auto close = [&] {
    if (open.second > open.first) ranges.push_back(open);
    open = {0, 0};
  };
  for (std::size_t l = 0; l < layout.layers(); ++l) {
    const std::size_t begin = layout.offsets[l], end = layout.offsets[l + 1], len = end - begin;
    if (len == 0) continue;
    if (len <= cap) {
      if (open.second > open.first && open.second == begin &&
          open.second - open.first + len <= cap) {
        open.second = end;
      } else {
        close();
        open = {begin, end};
      }
      continue;
    }
    close();
    const std::size_t align = cap >= kPlanAlign ? kPlanAlign : 1;
    const std::size_t parts = (len + cap - 1) / cap;
    std::size_t part = RoundUp((len + parts - 1) / parts, align);
    if (part > cap) part = cap / align * align;
    for (std::size_t s = begin; s < end; s += part) ranges.emplace_back(s, std::min(end, s + part));
  }
  close();
  return ranges;
}

// The bucket split evenly over the ranks, each boundary inside a layer rounded down to a multiple
// of kPlanAlign from the layer's start.
std::vector<std::size_t> ChunkBounds(const GradientLayout& layout, Range bucket, int world_size) {
  const std::size_t p = std::size_t(world_size), len = bucket.second - bucket.first;
  std::vector<std::size_t> bounds(p + 1);
  bounds[0] = bucket.first;
  bounds[p] = bucket.second;
  for (std::size_t j = 1; j < p; ++j) {
    std::size_t t = bucket.first + len * j / p;
    const std::size_t layer_begin = layout.offsets[std::size_t(LayerAt(layout.offsets, t))];
    if (t > layer_begin) t = layer_begin + (t - layer_begin) / kPlanAlign * kPlanAlign;
    bounds[j] = std::max(t, bounds[j - 1]);
  }
  return bounds;
}

void AddSegments(const GradientLayout& layout, Range chunk, std::vector<Segment>* segments) {
  if (chunk.second <= chunk.first) return;
  for (int l = LayerAt(layout.offsets, chunk.first);
       std::size_t(l) < layout.layers() && layout.offsets[std::size_t(l)] < chunk.second; ++l) {
    Segment s;
    s.layer = l;
    s.begin = std::max(chunk.first, layout.offsets[std::size_t(l)]);
    s.end = std::min(chunk.second, layout.offsets[std::size_t(l) + 1]);
    if (s.end > s.begin) segments->push_back(s);
  }
}

// Chunk d cut into pieces of piece_elems elements (after its segments were added).
void AddPieces(const BucketPlan& b, int d, std::size_t piece_elems, std::vector<Piece>* pieces) {
  std::size_t seg = b.seg_start[std::size_t(d)];
  for (std::size_t s = b.chunk_begin(d); s < b.chunk_end(d); s += piece_elems) {
    while (b.segments[seg].end <= s) ++seg;
    Piece pc;
    pc.chunk = d;
    pc.begin = s;
    pc.end = std::min(b.chunk_end(d), s + piece_elems);
    pc.first_segment = seg;
    pieces->push_back(pc);
  }
}

BucketPlan PlanBucket(const GradientLayout& layout, Range range, int world_size,
                      std::size_t piece_elems) {
  BucketPlan b;
  b.bounds.begin = range.first;
  b.bounds.end = range.second;
  b.bounds.chunk_bounds = ChunkBounds(layout, range, world_size);
  b.seg_start.assign(std::size_t(world_size) + 1, 0);
  b.piece_start.assign(std::size_t(world_size) + 1, 0);
  for (int d = 0; d < world_size; ++d) {
    b.max_chunk = std::max(b.max_chunk, b.chunk_end(d) - b.chunk_begin(d));
    b.seg_start[std::size_t(d)] = b.segments.size();
    AddSegments(layout, {b.chunk_begin(d), b.chunk_end(d)}, &b.segments);
    b.piece_start[std::size_t(d)] = b.pieces.size();
    AddPieces(b, d, piece_elems, &b.pieces);
  }
  b.seg_start[std::size_t(world_size)] = b.segments.size();
  b.piece_start[std::size_t(world_size)] = b.pieces.size();
  return b;
}

}  // namespace

std::span<const Segment> BucketPlan::segments_of(int d) const {
  return std::span<const Segment>(segments).subspan(
      seg_start[std::size_t(d)], seg_start[std::size_t(d) + 1] - seg_start[std::size_t(d)]);
}

std::span<const Piece> BucketPlan::pieces_of(int d) const {
  return std::span<const Piece>(pieces).subspan(
      piece_start[std::size_t(d)], piece_start[std::size_t(d) + 1] - piece_start[std::size_t(d)]);
}

AllReducePlan::AllReducePlan(const GradientLayout& layout, int world_size, double bucket_mb,
                             std::size_t piece_elems)
    : world_size_(world_size) {
  for (const Range& r : BucketRanges(layout, BucketCapacity(bucket_mb))) {
    buckets_.push_back(PlanBucket(layout, r, world_size, piece_elems));
  }
}

std::size_t AllReducePlan::max_chunk() const {
  std::size_t m = 0;
  for (const BucketPlan& b : buckets_) m = std::max(m, b.max_chunk);
  return m;
}

}  // namespace cpd::comm::internal
