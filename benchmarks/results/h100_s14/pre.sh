# sourced at the start of every device call of session 14 (the device copy is not pip-installed)
ln -sfn ../models treecompile/models
source .whl/device-install.sh
export OUT=${OUT:?}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/env.txt
python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $OUT/env.txt 2>&1
pip list 2>/dev/null | grep -i -E "flash|cutlass|tilelang|linear" >> $OUT/env.txt
cat $OUT/env.txt
