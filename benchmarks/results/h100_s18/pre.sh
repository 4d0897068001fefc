# sourced at the start of every device call of session 18 (the device copy is not pip-installed)
ln -sfn ../models treecompile/models
source .whl/device-install.sh
export OUT=${OUT:?}
# kernel caches in one place: tilelang's compiled GDN kernels (minutes on a fresh machine), Triton's, inductor's.
# A tarball of them carried in .kc/ (from an earlier machine) is unpacked once.
export TILELANG_CACHE_DIR=/tmp/kc/tilelang TRITON_CACHE_DIR=/tmp/kc/triton TORCHINDUCTOR_CACHE_DIR=/tmp/kc/inductor
mkdir -p /tmp/kc
if [ ! -f /tmp/kc/.unpacked ] && ls .kc/kc.tar.xz.* >/dev/null 2>&1; then
  cat .kc/kc.tar.xz.* | xz -dc | tar -C /tmp/kc -x && touch /tmp/kc/.unpacked && echo "pre: kernel caches unpacked: $(du -sh /tmp/kc | cut -f1)"
fi
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/env.txt
python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $OUT/env.txt 2>&1
pip list 2>/dev/null | grep -i -E "flash|cutlass|tilelang|linear" >> $OUT/env.txt
cat $OUT/env.txt
