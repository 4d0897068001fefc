# sourced at the start of every device call of session 18 (the device copy is not pip-installed)
ln -sfn ../models treecompile/models
source .whl/device-install.sh
export OUT=${OUT:?}
# kernel caches in one place: tilelang's compiled GDN kernels, Triton's (fla's kernels), inductor's.  The parts of a
# tarball of them from an earlier machine (kc_pack.sh), carried in .kc/ one per call, are stashed, and unpacked
# once all of those named in .kc/kc.sha256 are here.
export TILELANG_CACHE_DIR=/tmp/kc/tilelang TRITON_CACHE_DIR=/tmp/kc/triton TORCHINDUCTOR_CACHE_DIR=/tmp/kc/inductor
mkdir -p /tmp/kc /tmp/kcparts
cp -n .kc/kc.* /tmp/kcparts/ 2>/dev/null || true
if [ ! -f /tmp/kc/.unpacked ] && [ -f /tmp/kcparts/kc.sha256 ] && (cd /tmp/kcparts && sha256sum -c --quiet kc.sha256 2>/dev/null); then
  cat $(awk '{print "/tmp/kcparts/" $2}' /tmp/kcparts/kc.sha256) | xz -dc | tar -C /tmp/kc -x && touch /tmp/kc/.unpacked \
    && echo "pre: kernel caches unpacked: $(du -sh /tmp/kc | cut -f1)"
fi
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/env.txt
python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $OUT/env.txt 2>&1
pip list 2>/dev/null | grep -i -E "flash|cutlass|tilelang|linear" >> $OUT/env.txt
cat $OUT/env.txt
