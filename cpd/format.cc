#include "cpd/format.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <initializer_list>
#include <set>
#include <utility>

namespace cpd {

namespace {

using kernels::FloatGrid;
using kernels::MakeFloatGrid;
using kernels::NonFiniteStyle;

constexpr char kAccepted[] =
    "accepted: fp32, bf16, fp16, eXmY (1<=X<=8, 0<=Y<=23), e4m3, e5m2, e3m2, e2m3, e2m1, "
    "int<b>[:ch], uint<b>:minmax[:ch] (2<=b<=16), fp134|fp143|fp152[:room=N][:ch], "
    "log<b>[:ch|:tensor] (2<=b<=8), mxfp8|mxfp6|mxfp4, bfp<b>:<block> (2<=b<=16), "
    "binades:M0,M1,...[:room=N][:ch] (mantissa bits 0..22 per binade from the top, MxK for K "
    "binades of M bits, 1..127 binades, at most 16 bits); float modifiers :sat (default) :inf "
    ":nosub :ieee; block scales: nvfp4[:2d], "
    "FLOAT:block=RxC|tensor[:scale=fp32|e8m0|FLOAT][:tensor]";

Status BadSpec(std::string_view spec, const std::string& why) {
  return Status::InvalidArgument("bad format spec '" + std::string(spec) + "': " + why + " (" +
                                 kAccepted + ")");
}

// Parses a decimal integer that is the whole of `s`.
// Leading zeros are refused so that "e04m3" cannot name a different format than "e4m3".
bool ParseInt(std::string_view s, int* out) {
  if (s.empty() || (s.size() > 1 && s[0] == '0')) return false;
  const char* end = s.data() + s.size();
  auto [p, ec] = std::from_chars(s.data(), end, *out);
  return ec == std::errc() && p == end;
}

std::vector<std::string_view> Split(std::string_view s, char sep) {
  std::vector<std::string_view> parts;
  size_t start = 0;
  while (true) {
    const size_t pos = s.find(sep, start);
    parts.push_back(s.substr(start, pos == std::string_view::npos ? pos : pos - start));
    if (pos == std::string_view::npos) break;
    start = pos + 1;
  }
  return parts;
}

// The list of binades:M0,M1,...: entries M or MxK (K binades of M mantissa bits), top binade
// first. Fills `mbits` or returns why not.
Status ParseBinadeList(std::string_view spec, std::string_view list, std::vector<int32_t>* mbits) {
  if (list.empty()) {
    return BadSpec(spec,
                   "binades needs a list of mantissa bits per binade, top binade first, e.g. "
                   "binades:4x7,3,2,1,0");
  }
  for (std::string_view e : Split(list, ',')) {
    const size_t x = e.find('x');
    int m = 0, k = 1;
    const bool ok = x == std::string_view::npos
                        ? ParseInt(e, &m)
                        : ParseInt(e.substr(0, x), &m) && ParseInt(e.substr(x + 1), &k);
    const std::string quoted = "binades entry '" + std::string(e) + "'";
    if (!ok) {
      return BadSpec(spec, quoted + " is not M (mantissa bits) or MxK (K binades of M bits)");
    }
    if (m < 0 || m > 22) return BadSpec(spec, quoted + ": mantissa bits must be 0..22");
    if (k < 1 || k > kernels::kMaxBinades) {
      return BadSpec(spec, quoted + ": the repeat count K must be 1..127");
    }
    if (mbits->size() + size_t(k) > size_t(kernels::kMaxBinades)) {
      return BadSpec(spec, "binades takes 1..127 binades, this list has more");
    }
    mbits->insert(mbits->end(), size_t(k), m);
  }
  const int bits = kernels::BinadeBits(mbits->data(), int32_t(mbits->size()));
  if (bits > 16) {
    return BadSpec(spec, "binades list needs " + std::to_string(bits) +
                             " bits (sign + ceil(log2(1 + sum 2^Mi))), at most 16 are accepted");
  }
  return Status::Ok();
}

// The canonical spelling of a list: runs of three or more equal entries as MxK.
std::string CanonicalBinadeList(const std::vector<int32_t>& mbits) {
  std::string out;
  for (size_t i = 0; i < mbits.size();) {
    size_t j = i;
    while (j < mbits.size() && mbits[j] == mbits[i]) ++j;
    const std::string m = std::to_string(mbits[i]);
    for (size_t r = 0; r < (j - i >= 3 ? 1 : j - i); ++r) {
      if (!out.empty()) out += ",";
      out += m;
      if (j - i >= 3) out += "x" + std::to_string(j - i);
    }
    i = j;
  }
  return out;
}

// Modifiers after the base name, each used at most once.
struct Modifiers {
  bool sat = false, inf = false, nosub = false, ieee = false, ch = false, minmax = false;
  bool tensor = false;  // log<b>:tensor
  int room = 1;
  bool has_room = false;
  int block = 0;  // bfp
  std::vector<std::string> seen;
};

// The modifiers from parts[first] on (parts[0] is the name, and binades' list comes before its
// modifiers), each at most once, then the pairs that exclude each other.
Status ParseModifiers(std::string_view spec, const std::vector<std::string_view>& parts,
                      size_t first, Modifiers* mod) {
  for (size_t i = first; i < parts.size(); ++i) {
    const std::string_view p = parts[i];
    std::string key(p.substr(0, p.find('=')));
    for (const auto& s : mod->seen) {
      if (s == key) return BadSpec(spec, "modifier ':" + key + "' given twice");
    }
    mod->seen.push_back(key);
    if (p == "sat") {
      mod->sat = true;
    } else if (p == "inf") {
      mod->inf = true;
    } else if (p == "nosub") {
      mod->nosub = true;
    } else if (p == "ieee") {
      mod->ieee = true;
    } else if (p == "ch") {
      mod->ch = true;
    } else if (p == "tensor") {
      mod->tensor = true;
    } else if (p == "minmax") {
      mod->minmax = true;
    } else if (p.substr(0, 5) == "room=") {
      if (!ParseInt(p.substr(5), &mod->room) || mod->room < -8 || mod->room > 8) {
        return BadSpec(spec, "':" + std::string(p) + "' needs an integer room in -8..8");
      }
      mod->has_room = true;
    } else if (!p.empty() && ParseInt(p, &mod->block)) {
      mod->seen.back() = "<block>";
    } else {
      return BadSpec(spec, "unknown modifier ':" + std::string(p) + "'");
    }
  }
  if (mod->sat && mod->inf) return BadSpec(spec, ":sat and :inf exclude each other");
  if (mod->ch && mod->tensor) return BadSpec(spec, ":ch and :tensor exclude each other");
  return Status::Ok();
}

// A spec taken apart: what the family parsers read.
struct SpecParts {
  std::string_view spec;              // as given, for messages
  std::string_view name;              // the part before the first ':'
  int x = 0, y = 0;                   // eXmY's X and Y
  int b = 0;                          // the <b> of log<b>, bfp<b>, uint<b>, int<b>
  std::vector<int32_t> binade_mbits;  // binades' list, top binade first
  Modifiers mod;
};

// Refuses any modifier given that is not one of `ok`, naming the format.
Status AllowOnly(const SpecParts& s, std::initializer_list<std::string_view> ok) {
  for (const auto& given : s.mod.seen) {
    bool found = false;
    for (auto o : ok) found = found || given == o;
    if (!found) {
      return BadSpec(s.spec,
                     "modifier ':" + given + "' does not apply to '" + std::string(s.name) + "'");
    }
  }
  return Status::Ok();
}

ScaleScope TensorOrChannel(const Modifiers& mod) {
  return mod.ch ? ScaleScope::kChannel : ScaleScope::kTensor;
}

// A fixed float grid (bf16, fp16, eXmY) with the float modifiers.
Status FloatGridFields(const SpecParts& s, int ebits, int mbits, int bias, NonFiniteStyle style,
                       FormatFields* f) {
  CPD_RETURN_IF_ERROR(AllowOnly(s, {"sat", "inf", "nosub", "ieee"}));
  if (s.mod.inf && style == NonFiniteStyle::kAllFinite) {
    return BadSpec(s.spec,
                   "'" + std::string(s.name) + "' has no Inf or NaN code, so ':inf' cannot apply");
  }
  f->family = FormatFamily::kFloat;
  f->bits = 1 + ebits + mbits;
  f->grid = MakeFloatGrid(ebits, mbits, bias, style, !s.mod.nosub, s.mod.inf);
  if (f->grid.max_bits == 0) return BadSpec(s.spec, "this format has no nonzero finite value");
  if (s.mod.nosub && ebits == 1 && style == NonFiniteStyle::kIeee) {
    return BadSpec(s.spec, "with :nosub this format has no nonzero finite value");
  }
  return Status::Ok();
}

// ---- One parser per family: checks the modifiers and numbers, fills the fields.

Status ParseFp32(const SpecParts& s, FormatFields* f) {
  CPD_RETURN_IF_ERROR(AllowOnly(s, {"sat", "inf", "nosub"}));
  f->family = FormatFamily::kFloat32;
  f->bits = 32;
  f->flush_subnormals = s.mod.nosub;
  // The identity as a grid: rounding is a no-op and Inf stays Inf (NaN becomes the canonical
  // quiet NaN, as in every other format).
  f->grid = MakeFloatGrid(8, 23, 127, NonFiniteStyle::kIeee, !s.mod.nosub, true);
  return Status::Ok();
}

Status ParseBf16(const SpecParts& s, FormatFields* f) {
  return FloatGridFields(s, 8, 7, 127, NonFiniteStyle::kIeee, f);
}

Status ParseFp16(const SpecParts& s, FormatFields* f) {
  return FloatGridFields(s, 5, 10, 15, NonFiniteStyle::kIeee, f);
}

// IEEE-style eXmY, except the OCP formats e4m3 (no Inf) and e3m2, e2m3, e2m1 (all codes
// finite), which :ieee reads the IEEE way.
Status ParseExmy(const SpecParts& s, FormatFields* f) {
  if (s.x < 1 || s.x > 8) return BadSpec(s.spec, "exponent bits X must be 1..8");
  if (s.y < 0 || s.y > 23) return BadSpec(s.spec, "mantissa bits Y must be 0..23");
  NonFiniteStyle style = NonFiniteStyle::kIeee;
  const int bias = (1 << (s.x - 1)) - 1;
  if (!s.mod.ieee) {
    if (s.name == "e4m3") {
      style = NonFiniteStyle::kNanOnly;
    } else if (s.name == "e3m2" || s.name == "e2m3" || s.name == "e2m1") {
      style = NonFiniteStyle::kAllFinite;
    }
  }
  return FloatGridFields(s, s.x, s.y, bias, style, f);
}

// fp134, fp143, fp152: 1 sign, E exponent and M mantissa bits under a shared shift.
Status ParseFp1xy(const SpecParts& s, FormatFields* f) {
  CPD_RETURN_IF_ERROR(AllowOnly(s, {"room", "ch"}));
  const int ebits = s.name[3] - '0', mbits = s.name[4] - '0';
  // Unscaled, every exponent code 1..2^E-1 is a normal binade and the top one is [1, 2).
  const int bias = (1 << ebits) - 1;
  f->family = FormatFamily::kSharedShift;
  f->scope = TensorOrChannel(s.mod);
  f->bits = 8;
  f->grid = MakeFloatGrid(ebits, mbits, bias, NonFiniteStyle::kAllFinite, true, false);
  f->shift_rule = {s.mod.room, -126, 127};
  return Status::Ok();
}

// binades:<list>, the list already checked by ParseBinadeList.
Status ParseBinades(const SpecParts& s, FormatFields* f) {
  CPD_RETURN_IF_ERROR(AllowOnly(s, {"room", "ch"}));
  f->family = FormatFamily::kBinades;
  f->scope = TensorOrChannel(s.mod);
  const kernels::BinadeGrid g =
      kernels::MakeBinadeGrid(s.binade_mbits.data(), int32_t(s.binade_mbits.size()));
  f->bits = g.sign_shift + 1;
  f->binade_grid = std::make_shared<const kernels::BinadeGrid>(g);
  // As fp134: the top binade [2^s, 2^(s+1)), s = floor(log2 max|x|) + room.
  f->shift_rule = {s.mod.room, -126, 127};
  return Status::Ok();
}

Status ParseLog(const SpecParts& s, FormatFields* f) {
  CPD_RETURN_IF_ERROR(AllowOnly(s, {"ch", "tensor"}));
  if (s.b < 2 || s.b > 8) return BadSpec(s.spec, "log<b> needs 2 <= b <= 8");
  // Levels 2^(s-L+1)..2^s with L = 2^(b-1)-1: a float grid with M = 0 and b-1 exponent bits.
  const int ebits = s.b - 1;
  f->family = FormatFamily::kSharedShift;
  f->scope = TensorOrChannel(s.mod);
  f->scope_by_layer = !s.mod.ch && !s.mod.tensor;
  f->bits = s.b;
  f->grid = MakeFloatGrid(ebits, 0, (1 << ebits) - 1, NonFiniteStyle::kAllFinite, true, false);
  f->shift_rule = {0, -126, 127};
  return Status::Ok();
}

// mxfp8, mxfp6, mxfp4 (OCP MX v1.0).
Status ParseMx(const SpecParts& s, FormatFields* f) {
  CPD_RETURN_IF_ERROR(AllowOnly(s, {}));
  f->family = FormatFamily::kSharedShift;
  f->scope = ScaleScope::kBlock;
  f->block_size = 32;
  int emax = 0;
  if (s.name == "mxfp8") {
    f->grid = MakeFloatGrid(4, 3, 7, NonFiniteStyle::kNanOnly, true, false);
    f->bits = 8;
    emax = 8;
  } else if (s.name == "mxfp6") {
    f->grid = MakeFloatGrid(2, 3, 1, NonFiniteStyle::kAllFinite, true, false);
    f->bits = 6;
    emax = 2;
  } else {
    f->grid = MakeFloatGrid(2, 1, 1, NonFiniteStyle::kAllFinite, true, false);
    f->bits = 4;
    emax = 2;
  }
  // OCP MX v1.0: X = 2^(floor(log2 max|V|) - emax_elem), an E8M0 value in 2^-127..2^127.
  f->shift_rule = {-emax, -127, 127};
  return Status::Ok();
}

Status ParseBfp(const SpecParts& s, FormatFields* f) {
  CPD_RETURN_IF_ERROR(AllowOnly(s, {"<block>"}));
  if (s.b < 2 || s.b > 16) return BadSpec(s.spec, "bfp<b> needs 2 <= b <= 16");
  if (s.mod.block < 1 || s.mod.block > 65536) {
    return BadSpec(s.spec, "bfp<b> needs a block size ':N' with 1 <= N <= 65536");
  }
  // Sign + (b-1)-bit magnitude integer times 2^(e-(b-2)), e = floor(log2 max|block|): one
  // normal binade [2^e, 2^(e+1)) plus subnormals, i.e. a float grid with X = 1, M = b-2.
  f->family = FormatFamily::kSharedShift;
  f->scope = ScaleScope::kBlock;
  f->block_size = size_t(s.mod.block);
  f->bits = s.b;
  f->grid = MakeFloatGrid(1, s.b - 2, 1, NonFiniteStyle::kAllFinite, true, false);
  f->shift_rule = {0, -126, 127};
  return Status::Ok();
}

Status ParseUintMinMax(const SpecParts& s, FormatFields* f) {
  CPD_RETURN_IF_ERROR(AllowOnly(s, {"minmax", "ch"}));
  if (!s.mod.minmax) return BadSpec(s.spec, "uint<b> needs ':minmax'");
  if (s.b < 2 || s.b > 16) return BadSpec(s.spec, "uint<b> needs 2 <= b <= 16");
  f->family = FormatFamily::kUintMinMax;
  f->scope = TensorOrChannel(s.mod);
  f->bits = s.b;
  return Status::Ok();
}

Status ParseIntSymmetric(const SpecParts& s, FormatFields* f) {
  CPD_RETURN_IF_ERROR(AllowOnly(s, {"ch"}));
  if (s.b < 2 || s.b > 16) return BadSpec(s.spec, "int<b> needs 2 <= b <= 16");
  f->family = FormatFamily::kIntSymmetric;
  f->scope = TensorOrChannel(s.mod);
  f->bits = s.b;
  return Status::Ok();
}

// How the names of a family look.
enum class NameShape {
  kExact,     // the entry's name itself: "fp32", "mxfp4"
  kNumbered,  // the entry's name, then a decimal number <b>: "int8", "log4"
  kExmy,      // e<X>m<Y>, two decimal numbers
};

struct FamilyParser {
  NameShape shape;
  std::string_view name;  // kExact: the name; kNumbered: what precedes <b>; kExmy: unused
  Status (*parse)(const SpecParts&, FormatFields*);
};

// Every family's names and parser. No name has the shape of two entries.
constexpr FamilyParser kFamilyParsers[] = {
    {NameShape::kExact, "fp32", ParseFp32},
    {NameShape::kExact, "bf16", ParseBf16},
    {NameShape::kExact, "fp16", ParseFp16},
    {NameShape::kExmy, "", ParseExmy},
    {NameShape::kExact, "fp134", ParseFp1xy},
    {NameShape::kExact, "fp143", ParseFp1xy},
    {NameShape::kExact, "fp152", ParseFp1xy},
    {NameShape::kExact, "binades", ParseBinades},
    {NameShape::kNumbered, "log", ParseLog},
    {NameShape::kExact, "mxfp8", ParseMx},
    {NameShape::kExact, "mxfp6", ParseMx},
    {NameShape::kExact, "mxfp4", ParseMx},
    {NameShape::kNumbered, "bfp", ParseBfp},
    {NameShape::kNumbered, "uint", ParseUintMinMax},
    {NameShape::kNumbered, "int", ParseIntSymmetric},
};

// True when s->name has the entry's shape; then the numbers in it are in s->x, s->y or s->b.
bool HasShape(const FamilyParser& family, SpecParts* s) {
  const std::string_view name = s->name;
  switch (family.shape) {
    case NameShape::kExact:
      return name == family.name;
    case NameShape::kNumbered: {
      const std::string_view prefix = family.name;
      return name.size() > prefix.size() && name.substr(0, prefix.size()) == prefix &&
             ParseInt(name.substr(prefix.size()), &s->b);
    }
    case NameShape::kExmy: {
      const size_t m = name.find('m');
      return name.size() >= 4 && name[0] == 'e' && m != std::string_view::npos &&
             ParseInt(name.substr(1, m - 1), &s->x) && ParseInt(name.substr(m + 1), &s->y);
    }
  }
  return false;
}

// The family whose names have the shape of s->name (its numbers then in s), or null.
const FamilyParser* FindFamily(SpecParts* s) {
  for (const FamilyParser& family : kFamilyParsers) {
    if (HasShape(family, s)) return &family;
  }
  return nullptr;
}

// Name, then the modifiers that change behaviour, in a fixed order.
std::string CanonicalSpelling(const SpecParts& s, const FormatFields& f) {
  const Modifiers& mod = s.mod;
  std::string canon(s.name);
  if (s.name == "binades") canon += ":" + CanonicalBinadeList(s.binade_mbits);
  if (f.family == FormatFamily::kFloat && mod.ieee) canon += ":ieee";
  if (mod.inf) canon += ":inf";
  if (mod.nosub) canon += ":nosub";
  if (mod.minmax) canon += ":minmax";
  if (mod.has_room && mod.room != 1) canon += ":room=" + std::to_string(mod.room);
  if (mod.ch) canon += ":ch";
  if (mod.tensor) canon += ":tensor";
  if (f.family == FormatFamily::kSharedShift && f.scope == ScaleScope::kBlock &&
      s.name.substr(0, 3) == "bfp") {
    canon += ":" + std::to_string(mod.block);
  }
  return canon;
}

// ---- Block-scaled formats: FLOAT:block=RxC[:scale=S][:tensor], nvfp4[:2d].

bool IsBlockScaledSpec(const std::vector<std::string_view>& parts) {
  if (parts[0] == "nvfp4") return true;
  for (size_t i = 1; i < parts.size(); ++i) {
    if (parts[i].substr(0, 6) == "block=") return true;
  }
  return false;
}

// "RxC" or "N" (1 x N), each side 1..65536, at most 2^20 elements; or "tensor".
Status ParseBlockShape(std::string_view spec, std::string_view text, FormatFields* f) {
  if (text == "tensor") {
    f->block_rows = f->block_cols = kWholeTensorBlock;
    return Status::Ok();
  }
  const size_t x = text.find('x');
  int r = 1, c = 0;
  const bool ok = x == std::string_view::npos
                      ? ParseInt(text, &c)
                      : ParseInt(text.substr(0, x), &r) && ParseInt(text.substr(x + 1), &c);
  if (!ok || r < 1 || c < 1 || r > 65536 || c > 65536 ||
      size_t(r) * size_t(c) > (size_t(1) << 20)) {
    return BadSpec(spec, "':block=" + std::string(text) +
                             "' needs RxC (or N for 1xN): rows and columns 1..65536 of a block, "
                             "at most 2^20 elements; or 'tensor' for one block over the tensor");
  }
  f->block_rows = size_t(r);
  f->block_cols = size_t(c);
  return Status::Ok();
}

Status ParseBlockScale(std::string_view spec, std::string_view text, FormatFields* f) {
  if (text == "fp32") {
    f->scale_type = BlockScaleType::kFloat32;
    return Status::Ok();
  }
  if (text == "e8m0") {
    f->scale_type = BlockScaleType::kPow2;
    return Status::Ok();
  }
  auto scale = Format::Parse(text);
  if (!scale.ok() || scale->family() != FormatFamily::kFloat) {
    return BadSpec(spec, "':scale=" + std::string(text) +
                             "' needs fp32, e8m0 (a power of two) or a float format such as e4m3");
  }
  f->scale_type = BlockScaleType::kFloatGrid;
  f->scale_grid = scale->grid();
  f->scale_bits = scale->bits();
  return Status::Ok();
}

// Fills f from a block-scaled spec; *canon receives its canonical spelling.
Status ParseBlockScaled(std::string_view spec, const std::vector<std::string_view>& parts,
                        FormatFields* f, std::string* canon) {
  std::string element;
  std::string_view block, scale = "fp32";
  bool tensor = false, two_d = false;
  std::set<std::string> seen;
  for (size_t i = 1; i < parts.size(); ++i) {
    const std::string key(parts[i].substr(0, parts[i].find('=')));
    if (!seen.insert(key).second) return BadSpec(spec, "modifier ':" + key + "' given twice");
  }
  if (parts[0] == "nvfp4") {
    // NVIDIA's NVFP4: E2M1 in 1x16 blocks (16x16 for weights with :2d) with E4M3 scales under
    // a float32 tensor level.
    for (size_t i = 1; i < parts.size(); ++i) {
      if (parts[i] != "2d") {
        return BadSpec(
            spec, "nvfp4 takes only ':2d' (16x16 blocks), not ':" + std::string(parts[i]) + "'");
      }
      two_d = true;
    }
    element = "e2m1";
    block = two_d ? "16x16" : "1x16";
    scale = "e4m3";
    tensor = true;
  } else {
    element = std::string(parts[0]);
    for (size_t i = 1; i < parts.size(); ++i) {
      const std::string_view p = parts[i];
      if (p.substr(0, 6) == "block=") {
        block = p.substr(6);
      } else if (p.substr(0, 6) == "scale=") {
        scale = p.substr(6);
      } else if (p == "tensor") {
        tensor = true;
      } else {
        element += ":" + std::string(p);
      }
    }
  }
  auto elem = Format::Parse(element);
  if (!elem.ok()) return elem.status();  // names the element's own fault
  if (elem->family() != FormatFamily::kFloat) {
    return BadSpec(spec,
                   "block scales apply to a float element format (eXmY, e4m3, e2m1, "
                   "bf16, ...), not '" +
                       element + "'");
  }
  CPD_RETURN_IF_ERROR(ParseBlockShape(spec, block, f));
  CPD_RETURN_IF_ERROR(ParseBlockScale(spec, scale, f));
  if (tensor && f->scale_type != BlockScaleType::kFloatGrid) {
    return BadSpec(spec,
                   "':tensor' (a float32 tensor level) needs block scales on a float "
                   "grid such as ':scale=e4m3'");
  }
  f->family = FormatFamily::kBlockScaled;
  f->scope = ScaleScope::kBlock;
  f->bits = elem->bits();
  f->grid = elem->grid();
  f->block_size = f->block_rows * f->block_cols;
  f->tensor_level = tensor;
  // MX's rule: X = 2^(floor(log2 amax) - emax_elem), an E8M0 value in 2^-127..2^127.
  const int32_t emax_elem = kernels::FloorLog2(kernels::BitsFloat(f->grid.max_bits));
  f->shift_rule = {-emax_elem, -127, 127};
  const std::string shape =
      f->block_rows == kWholeTensorBlock
          ? std::string("tensor")
          : std::to_string(f->block_rows) + "x" + std::to_string(f->block_cols);
  if (element == "e2m1" && f->scale_type == BlockScaleType::kFloatGrid && scale == "e4m3" &&
      tensor && (shape == "1x16" || shape == "16x16")) {
    *canon = shape == "1x16" ? "nvfp4" : "nvfp4:2d";
  } else {
    *canon = elem->spec() + ":block=" + shape + ":scale=" +
             (f->scale_type == BlockScaleType::kFloatGrid
                  ? Format::Parse(scale)->spec()
                  : std::string(f->scale_type == BlockScaleType::kPow2 ? "e8m0" : "fp32")) +
             (tensor ? ":tensor" : "");
  }
  return Status::Ok();
}

}  // namespace

const char* FormatSpecHelp() {
  return "A format spec is a name with optional ':modifiers'. Floats: fp32, bf16, fp16 "
         "(IEEE binary16), eXmY for 1<=X<=8, 0<=Y<=23 (IEEE-style: bias 2^(X-1)-1, "
         "subnormals, top exponent reserved for Inf/NaN); OCP e4m3 (bias 7, max 448, no Inf), "
         "e5m2, e3m2, e2m3, e2m1 (all codes finite; add :ieee for the IEEE-style eXmY reading). "
         "Float modifiers: :sat saturate overflow to +-max (default), :inf IEEE overflow to Inf "
         "(NaN where there is no Inf), :nosub flush subnormal results to zero. Integers: int<b> "
         "symmetric linear with a per-tensor max-abs scale, int<b>:ch per output channel, "
         "uint<b>:minmax[:ch] asymmetric range (CPT), 2<=b<=16. Shared-exponent 8-bit floats "
         "(Lee et al.): fp134, fp143, fp152 with top binade [2^s, 2^(s+1)), "
         "s = floor(log2 max|x|) + room (:room=N, default 1), per tensor or per channel (:ch). "
         "log<b> (2<=b<=8): sign and powers of two 2^(s-L+1)..2^s, L = 2^(b-1)-1, "
         "s = floor(log2 max|x|); in training per output channel for convolutions and per tensor "
         "for other layers (Lee et al.), :ch per channel and :tensor per tensor for every layer; "
         "elsewhere per tensor unless :ch. Block formats: mxfp8 (e4m3), mxfp6 (e2m3), mxfp4 (e2m1) "
         "with "
         "32-element blocks and an E8M0 scale (OCP MX v1.0); bfp<b>:<block> block floating point "
         "(sign + b-1 magnitude bits under a shared exponent). Per-binade formats (Lee et al.'s "
         "candidates: fixed point, floats, float-fix hybrids): binades:M0,M1,...[:room=N][:ch] "
         "gives M_i mantissa bits (0..22) to binade i, top binade first (MxK: K binades of M "
         "bits; 1..127 binades); unscaled, binade i is [2^-i, 2^(1-i)) and only 0 lies below the "
         "lowest, so a list ending in 0 has gradual underflow; the shift is chosen as for fp134; "
         "codes take 1 + ceil(log2(1 + sum 2^M_i)) <= 16 bits (fp134 = binades:4x7,3,2,1,0). "
         "Block scales: FLOAT:block=RxC[:scale=fp32|e8m0|FLOAT][:tensor] puts a float element "
         "format under one scale per R x C block of the tensor's matrix view (rows of its last "
         "dimension; weights [out, fan-in]; block=N is 1xN; block=tensor one block over the "
         "whole tensor, e4m3:block=tensor being FP8 with a per-tensor scale), the scale float32 "
         "(default, "
         "DeepSeek-V3: e4m3:block=1x128, e4m3:block=128x128), a power of two (e8m0, OCP MX's "
         "rule) or a float format (e4m3) optionally under a float32 tensor level (:tensor); "
         "nvfp4 = e2m1:block=1x16:scale=e4m3:tensor (NVIDIA NVFP4), nvfp4:2d its 16x16 blocks.";
}

std::vector<std::string> SplitFormatList(std::string_view list) {
  std::vector<std::string> out;
  for (std::string_view piece : Split(list, ',')) {
    if (piece.empty()) continue;
    const bool continues = piece[0] >= '0' && piece[0] <= '9' && !out.empty();
    if (continues) {
      out.back() += "," + std::string(piece);
    } else {
      out.emplace_back(piece);
    }
  }
  return out;
}

// The checks run in a fixed order, so that a spec with several faults is always refused for
// the same one: the name, binades' list, the modifiers, then the family's own checks.
Result<Format> Format::Parse(std::string_view spec) {
  // A lambda in a member function may set the private fields.
  auto build = [](std::string canon, FormatFields& fields) {
    Format f;
    f.spec_ = std::move(canon);
    f.fields_ = std::move(fields);
    return f;
  };
  const std::vector<std::string_view> parts = Split(spec, ':');
  SpecParts s;
  s.spec = spec;
  s.name = parts[0];
  if (s.name.empty()) return BadSpec(spec, "empty format name");
  if (IsBlockScaledSpec(parts)) {
    FormatFields fields;
    std::string canon;
    CPD_RETURN_IF_ERROR(ParseBlockScaled(spec, parts, &fields, &canon));
    return build(std::move(canon), fields);
  }
  // binades:<list> carries its list as the first part after the name.
  const bool binades = s.name == "binades";
  if (binades) {
    CPD_RETURN_IF_ERROR(
        ParseBinadeList(spec, parts.size() > 1 ? parts[1] : std::string_view(), &s.binade_mbits));
  }
  CPD_RETURN_IF_ERROR(ParseModifiers(spec, parts, binades ? 2 : 1, &s.mod));

  const FamilyParser* family = FindFamily(&s);
  if (family == nullptr) return BadSpec(spec, "unknown format name '" + std::string(s.name) + "'");
  FormatFields fields;
  CPD_RETURN_IF_ERROR(family->parse(s, &fields));
  return build(CanonicalSpelling(s, fields), fields);
}

size_t Format::meta_bytes_per_group() const {
  switch (family()) {
    case FormatFamily::kFloat32:
    case FormatFamily::kFloat:
      return 0;
    case FormatFamily::kSharedShift:
    case FormatFamily::kBinades:
      return 1;  // int8 shift (MX: the E8M0 byte, shift + 127)
    case FormatFamily::kIntSymmetric:
      return 4;  // float32 scale
    case FormatFamily::kUintMinMax:
      return 8;  // float32 min, float32 scale
    case FormatFamily::kBlockScaled:
      switch (scale_type()) {
        case BlockScaleType::kPow2:
          return 1;  // the E8M0 byte
        case BlockScaleType::kFloat32:
          return 4;  // the decode scale, float32
        case BlockScaleType::kFloatGrid:
          return size_t(scale_bits() + 7) / 8;  // the scale's code
      }
  }
  return 0;
}

BlockGridShape BlockGridOf(const Format& format, size_t n, size_t channels, size_t columns) {
  BlockGridShape g;
  if (n == 0) return g;
  g.cols = columns > 0 ? columns : n / std::max<size_t>(channels, 1);
  if (g.cols == 0) return g;
  g.rows = n / g.cols;
  g.block_rows = (g.rows + format.block_rows() - 1) / format.block_rows();
  g.block_cols = (g.cols + format.block_cols() - 1) / format.block_cols();
  return g;
}

size_t Format::num_groups(size_t n, size_t channels, size_t columns) const {
  if (family() == FormatFamily::kBlockScaled) {
    const BlockGridShape g = BlockGridOf(*this, n, channels, columns);
    return g.block_rows * g.block_cols;
  }
  switch (scope()) {
    case ScaleScope::kNone:
      return 0;
    case ScaleScope::kTensor:
      return 1;
    case ScaleScope::kChannel:
      return channels;
    case ScaleScope::kBlock:
      return (n + block_size() - 1) / block_size();
  }
  return 0;
}

FormatInfo Format::Info() const {
  FormatInfo info;
  info.bits = bits();
  switch (family()) {
    case FormatFamily::kFloat32:
      info.max_finite = 3.4028234663852886e38;
      info.min_normal = std::ldexp(1.0, -126);
      info.min_subnormal = flush_subnormals() ? 0.0 : std::ldexp(1.0, -149);
      info.distinct_finite = (uint64_t(1) << 32) - (uint64_t(1) << 24) - 1 -
                             (flush_subnormals() ? 2 * ((uint64_t(1) << 23) - 1) : 0);
      break;
    case FormatFamily::kFloat:
    case FormatFamily::kSharedShift:
    case FormatFamily::kBlockScaled: {
      const FloatGrid& g = grid();
      info.max_finite = kernels::BitsFloat(g.max_bits);
      const bool has_normal = (g.max_code >> g.mbits) > 0;
      info.min_normal = has_normal ? std::ldexp(1.0, g.emin) : 0.0;
      info.min_subnormal = g.subnormals && g.mbits > 0 ? g.quantum : 0.0;
      uint64_t magnitudes = uint64_t(g.max_code) + 1;  // codes 0..max_code are all finite
      if (!g.subnormals) magnitudes -= (uint64_t(1) << g.mbits) - 1;
      info.distinct_finite = 2 * magnitudes - 1;
      if (family() == FormatFamily::kSharedShift) {
        const char* where = scope() == ScaleScope::kTensor    ? "tensor"
                            : scope() == ScaleScope::kChannel ? "channel"
                                                              : "block";
        info.scale_note = std::string("values shown at shift s = 0; each ") + where +
                          " is scaled by 2^s, s chosen from its max |x|";
      }
      if (family() == FormatFamily::kBlockScaled) {
        const std::string shape = std::to_string(block_rows()) + "x" + std::to_string(block_cols());
        info.scale_note =
            "element values shown unscaled; each " + shape + " block is scaled by " +
            (scale_type() == BlockScaleType::kPow2
                 ? std::string("2^s (E8M0), s = floor(log2 max|x|) - emax of the element")
             : scale_type() == BlockScaleType::kFloat32
                 ? std::string("a float32 max|x| / max element")
                 : std::string("max|x| / max element rounded to its scale format") +
                       (tensor_level() ? ", under a float32 tensor scale" : ""));
      }
      break;
    }
    case FormatFamily::kBinades: {
      const kernels::BinadeGrid& g = binade_grid();
      info.max_finite = kernels::BitsFloat(g.max_bits);
      // "Normal" are the binades of the top run, those with the top binade's mantissa bits, and
      // "subnormal" any value below them: fp1xy lists then report their float's numbers
      // (fp134: 2^-6 and 2^-10), a 0,0,...,0 list log<b>'s, a fixed-point list bfp<b>'s.
      int32_t run = 1;
      while (run < g.count && kernels::BinadeMbits(g, run) == kernels::BinadeMbits(g, 0)) ++run;
      info.min_normal = std::ldexp(1.0, 1 - run);
      info.min_subnormal = run < g.count ? std::ldexp(1.0, 1 - g.count) : 0.0;
      info.distinct_finite = 2 * uint64_t(g.max_code) + 1;
      info.scale_note = std::string("values shown at shift s = 0; each ") +
                        (scope() == ScaleScope::kChannel ? "channel" : "tensor") +
                        " is scaled by 2^s, s chosen from its max |x|";
      break;
    }
    case FormatFamily::kIntSymmetric: {
      const int qmax = (1 << (bits() - 1)) - 1;
      info.max_finite = qmax;
      info.min_normal = 1;
      info.distinct_finite = 2 * uint64_t(qmax) + 1;
      info.scale_note = "integer levels shown; value = q * scale, scale = max|x| / " +
                        std::to_string(qmax) +
                        (scope() == ScaleScope::kChannel ? " per channel" : " per tensor");
      break;
    }
    case FormatFamily::kUintMinMax: {
      const int qmax = (1 << bits()) - 1;
      info.max_finite = qmax;
      info.min_normal = 1;
      info.distinct_finite = uint64_t(qmax) + 1;
      info.scale_note = "integer levels shown; value = min + q * scale, scale = (max - min) / " +
                        std::to_string(qmax) +
                        (scope() == ScaleScope::kChannel ? " per channel" : " per tensor");
      break;
    }
  }
  return info;
}

const kernels::BinadeGrid& Format::binade_grid() const {
  static const kernels::BinadeGrid kEmpty{};
  return fields_.binade_grid != nullptr ? *fields_.binade_grid : kEmpty;
}

std::vector<int> Format::binade_mbits() const {
  std::vector<int> m;
  const kernels::BinadeGrid& g = binade_grid();
  for (int32_t i = 0; i < g.count; ++i) m.push_back(int(kernels::BinadeMbits(g, i)));
  return m;
}

Result<std::vector<float>> Format::Values() const {
  if (bits() > 16) {
    return Status::InvalidArgument("format '" + spec_ + "' has " + std::to_string(bits()) +
                                   " bits; values are listed only for formats of <= 16 bits");
  }
  std::set<float> values;
  if (is_float_grid() || family() == FormatFamily::kBlockScaled) {
    for (uint32_t code = 0; code < (1u << bits()); ++code) {
      const float v = kernels::DecodeFloatGrid(code, grid());
      if (!std::isfinite(v)) continue;
      // Codes a round never produces under :nosub (nonzero subnormals) are not values.
      const uint32_t mag = code & ((1u << (bits() - 1)) - 1u);
      if (!grid().subnormals && mag != 0 && (mag >> grid().mbits) == 0) continue;
      values.insert(v == 0.0f ? 0.0f : v);
    }
  } else if (family() == FormatFamily::kBinades) {
    const kernels::BinadeGrid& g = binade_grid();
    for (uint32_t mag = 0; mag <= g.max_code; ++mag) {
      const float v = kernels::DecodeBinadeGrid(mag, g);
      values.insert(v);
      values.insert(-v);  // -0 is not inserted: it compares equal to +0
    }
  } else if (family() == FormatFamily::kIntSymmetric) {
    const int qmax = (1 << (bits() - 1)) - 1;
    for (int q = -qmax; q <= qmax; ++q) values.insert(float(q));
  } else {
    for (int q = 0; q < (1 << bits()); ++q) values.insert(float(q));
  }
  return std::vector<float>(values.begin(), values.end());
}

}  // namespace cpd
