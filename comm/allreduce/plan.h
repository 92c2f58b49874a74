// The geometry of the gradient all-reduce, fixed at Create from the layout, the world size and
// the options: which flat ranges travel together (buckets), which rank reduces which part of a
// bucket (chunks), where layers cut the chunks (segments), and the work items of a pipelined
// algorithm (pieces). Flat element indices only: nothing here knows about formats, arithmetic,
// memory spaces or the transport, so host and device implementations share one plan.
// comm/gradient_allreduce.h states the rules (bucket splits and chunk bounds at multiples of 64
// elements from a layer's start); internal to comm/.
#pragma once

#include <cstddef>
#include <span>
#include <vector>

#include "comm/gradient_allreduce.h"

namespace cpd::comm::internal {

// Chunk boundaries inside a layer, and split points of layers larger than a bucket, fall on
// multiples of this many elements from the layer's start: MX/bfp blocks (16 or 32) then count
// from the layer's start, and packed codes of any width start on a byte.
inline constexpr std::size_t kPlanAlign = 64;

// A layer's part of one chunk: flat [begin, end) of layer `layer`.
struct Segment {
  int layer = 0;
  std::size_t begin = 0;
  std::size_t end = 0;
  std::size_t size() const { return end - begin; }
};

// A work item of a pipelined algorithm: flat [begin, end) inside chunk `chunk`, starting a
// multiple of the piece size from the chunk's start; first_segment indexes the bucket's first
// segment that overlaps it.
struct Piece {
  int chunk = 0;
  std::size_t begin = 0;
  std::size_t end = 0;
  std::size_t first_segment = 0;
  std::size_t size() const { return end - begin; }
};

struct BucketPlan {
  GradientBucket bounds;  // [begin, end) and the chunk of each rank, as buckets() reports them
  std::vector<Segment> segments;         // chunk by chunk, in flat order
  std::vector<std::size_t> seg_start;    // world_size + 1: chunk d's are [seg_start[d], [d + 1])
  std::vector<Piece> pieces;             // chunk by chunk, in flat order
  std::vector<std::size_t> piece_start;  // world_size + 1, as seg_start
  std::size_t max_chunk = 0;             // elements of the longest chunk

  std::size_t size() const { return bounds.end - bounds.begin; }
  std::size_t chunk_begin(int d) const { return bounds.chunk_bounds[std::size_t(d)]; }
  std::size_t chunk_end(int d) const { return bounds.chunk_bounds[std::size_t(d) + 1]; }
  std::span<const Segment> segments_of(int d) const;
  std::span<const Piece> pieces_of(int d) const;
};

class AllReducePlan {
 public:
  // REQUIRED: a layout Create accepted, world_size >= 1, bucket_mb > 0 and finite, piece_elems a
  // positive multiple of 8 (so that packed codes of a piece start on a byte).
  AllReducePlan(const GradientLayout& layout, int world_size, double bucket_mb,
                std::size_t piece_elems);

  int world_size() const { return world_size_; }
  const std::vector<BucketPlan>& buckets() const { return buckets_; }
  // The longest chunk of any bucket, in elements.
  std::size_t max_chunk() const;

 private:
  int world_size_;
  std::vector<BucketPlan> buckets_;
};

}  // namespace cpd::comm::internal
