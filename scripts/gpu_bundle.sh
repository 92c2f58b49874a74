#!/usr/bin/env bash
# Builds, on this machine, what a GPU machine without CPD's Debian libraries needs to run CPD's
# CUDA tests, benchmarks and cpd-train, and packs it into one ignored folder (.gpu/ by default,
# at most 64 MiB): payload.tar.xz (stripped executables, libgomp, the Fashion-MNIST files) and
# MANIFEST. scripts/gpu_run.sh unpacks and runs it there, with LD_LIBRARY_PATH pointing at the
# machine's own CUDA 13, cuBLAS, cuDNN and NCCL (its PyTorch installation's NVIDIA packages).
#   scripts/gpu_bundle.sh              build (build-gpu/) and pack into .gpu/
#   scripts/gpu_bundle.sh --dry-run    ... then run the bundle here as the GPU machine would
#                                      (`gpu_run.sh all`: CPU tests pass, CUDA tests skip and the
#                                      GPU-only steps print SKIP lines without a GPU)
# Environment: BUNDLE_DIR (.gpu), BUILD_DIR (build-gpu), JOBS (nproc), CUDA_ARCHS (90).
# The build: CUDA, NCCL and MPI on; gRPC and oneDNN off; OpenBLAS, zlib, yaml-cpp, libstdc++ and
# libgcc static (CPD_PORTABLE); the CUDA libraries stay shared, taken from the GPU machine, and so
# does MPI: libmpi.so.40, the soname of Open MPI 4.x (Debian 12's 4.1.4 here; the GPU machine's
# Ubuntu/Debian Open MPI 4.1.6 there), and nothing else of it (no libmpi_cxx).
set -euo pipefail
cd "$(dirname "$0")/.."

BUNDLE_DIR=${BUNDLE_DIR:-.gpu}
BUILD_DIR=${BUILD_DIR:-build-gpu}
JOBS=${JOBS:-$(nproc)}
CUDA_ARCHS=${CUDA_ARCHS:-90}
DRY_RUN=0
for a in "$@"; do
  case $a in
    --dry-run) DRY_RUN=1 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "gpu_bundle.sh: unknown argument '$a' (accepted: --dry-run)" >&2; exit 2 ;;
  esac
done
LIMIT_BYTES=$((64 * 1024 * 1024))

# What the GPU machine runs: the CUDA tests, the CPU tests that need no gRPC (the dry run's
# evidence that the bundle works), the MPI suites, the benchmarks and the tools.
CUDA_TESTS=(quantize_cuda_test codec_cuda_test transform_cuda_test reduce_kernels_cuda_test
            layers_cuda_test transformer_layers_cuda_test train_cuda_test cpd_train_cuda_test
            nccl_communicator_test gradient_allreduce_cuda_test gradient_buffers_test)
CPU_TESTS=(status_test format_test codec_test block_scaled_test transform_test properties_test
           hysteresis_test ieee_oracle_test cuda_oracle_test schedule_test reduce_kernels_test
           layers_test models_test optimizer_test quant_sites_test trainer_test data_test
           cpd_quant_cli_test cpd_train_cli_test transformer_layers_test recurrent_test
           progress_mode_test)
# Suites that gpu_run.sh runs only under mpirun (the GPU machine's Open MPI); the CUDA suite
# gradient_allreduce_cuda_test runs there too, at 2 and 4 ranks sharing the GPU.
MPI_TESTS=(gradient_allreduce_test)
TOOLS=(cpd-train cpd-quant bench_quantize_cuda bench_quantize bench_train_step bench_layers
       cpd-allreduce-bench)

echo "gpu_bundle: [1/4] packages"
bash scripts/install_deps.sh
# The static Fortran runtime that Debian's static OpenBLAS needs (libgfortran.a).
if [ ! -f "$(g++ -print-file-name=libgfortran.a)" ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends gfortran \
    >/dev/null
fi
command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ] ||
  { echo "gpu_bundle: no CUDA toolkit (nvcc) on this machine" >&2; exit 1; }
export PATH=$PATH:/usr/local/cuda/bin

echo "gpu_bundle: [2/4] configure and build $BUILD_DIR (CUDA, MPI on; gRPC, oneDNN off; static deps)"
generator=()
command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
cmake -S . -B "$BUILD_DIR" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DCPD_WITH_CUDA=ON \
  -DCPD_WITH_NCCL=ON -DCPD_WITH_MPI=ON -DCPD_WITH_GRPC=OFF -DCPD_WITH_DNNL=OFF \
  -DCPD_PORTABLE=ON -DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCHS" >/dev/null
# What the configuration found (a missing dependency turns its option off with a warning).
for feature in CUDA NCCL MPI; do
  grep -q "#define CPD_WITH_$feature 1" "$BUILD_DIR/generated/cpd/config.h" ||
    { echo "gpu_bundle: CMake switched $feature off (see its warnings above)" >&2; exit 1; }
done
echo "  building ${#CUDA_TESTS[@]} CUDA tests, ${#CPU_TESTS[@]} CPU tests, ${#MPI_TESTS[@]} MPI" \
  "suite(s) and ${#TOOLS[@]} tools (from scratch: 20 to 60 minutes on 2 cores)"
cmake --build "$BUILD_DIR" -j "$JOBS" --target "${CUDA_TESTS[@]}" "${CPU_TESTS[@]}" \
  "${MPI_TESTS[@]}" "${TOOLS[@]}"

echo "gpu_bundle: [3/4] pack $BUNDLE_DIR"
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin" "$stage/lib" "$stage/data/fashion-mnist"
for t in "${CUDA_TESTS[@]}" "${CPU_TESTS[@]}" "${MPI_TESTS[@]}" "${TOOLS[@]}"; do
  strip -o "$stage/bin/$t" "$BUILD_DIR/bin/$t"
done
cp -L "$(g++ -print-file-name=libgomp.so.1)" "$stage/lib/"
cp /usr/share/datasets/fashion-mnist/*.gz "$stage/data/fashion-mnist/"
printf '%s\n' "${CUDA_TESTS[@]}" >"$stage/cuda_tests"
printf '%s\n' "${CPU_TESTS[@]}" >"$stage/cpu_tests"
printf '%s\n' "${MPI_TESTS[@]}" >"$stage/mpi_tests"
# Every shared library an executable asks for that is neither in lib/ nor part of the C library,
# CUDA or Open MPI's libmpi.so.40 must be absent: the GPU machine has no Debian packages.
allowed='^((linux-vdso|libc|libm|libdl|libpthread|librt|ld-linux(-x86-64)?|libgomp|libcuda|libcudart|libcublas|libcublasLt|libcudnn|libnccl)\.so|libmpi\.so\.40$)'
for f in "$stage"/bin/*; do
  extra=$(objdump -p "$f" | awk '/NEEDED/ {print $2}' | grep -Ev "$allowed" || true)
  if [ -n "$extra" ]; then
    echo "gpu_bundle: $(basename "$f") needs libraries the GPU machine lacks: $extra" >&2
    exit 1
  fi
done
{
  echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) from $(git rev-parse --short HEAD)$(git diff --quiet || echo '+dirty')"
  echo "cuda archs $CUDA_ARCHS; nvcc $(nvcc --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')"
  echo "needs at run time (shared):"
  objdump -p "$stage"/bin/* | awk '/NEEDED/ {print "  " $2}' | sort -u
} >"$stage/MANIFEST"
tmp_bundle=$(mktemp -d "${BUNDLE_DIR%/}.tmp.XXXXXX")
# One xz stream with a dictionary larger than the tar: the executables share most of their code
# (static OpenBLAS, the CUDA kernels), which compresses away only within the dictionary's reach
# (about 320 MB -> 10 MB, against 40 MB with xz's default 8 MiB dictionary; about 2 minutes).
echo "  compressing $(du -sh "$stage" | cut -f1) (about 2 minutes)"
tar -C "$stage" -cf - . | xz -9 --lzma2=dict=384MiB -T1 >"$tmp_bundle/payload.tar.xz"
cp "$stage/MANIFEST" "$tmp_bundle/MANIFEST"
size=$(du -cb "$tmp_bundle" | tail -1 | cut -f1)
if [ "$size" -gt "$LIMIT_BYTES" ]; then
  echo "gpu_bundle: the bundle is $((size / 1048576)) MiB, over the 64 MiB a device call carries" >&2
  rm -rf "$tmp_bundle"
  exit 1
fi
rm -rf "$BUNDLE_DIR"
mv "$tmp_bundle" "$BUNDLE_DIR"
git check-ignore -q "$BUNDLE_DIR" ||
  echo "gpu_bundle: warning: $BUNDLE_DIR is not ignored by git; a device call would send it twice"
echo "gpu_bundle: $BUNDLE_DIR is $((size / 1048576)) MiB ($(ls "$stage/bin" | wc -l) executables)"

echo "gpu_bundle: [4/4] dry run"
if [ "$DRY_RUN" -eq 1 ]; then
  BUNDLE_DIR=$BUNDLE_DIR bash scripts/gpu_run.sh all
else
  echo "  skipped (pass --dry-run); on the GPU machine: bash scripts/gpu_run.sh all"
fi
