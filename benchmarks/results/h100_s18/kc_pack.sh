# pack the kernel caches into $OUT as xz parts of < 16 MiB (carry them in .kc/ on a later machine)
du -sh /tmp/kc/* 2>/dev/null
tar -C /tmp/kc -c tilelang triton 2>/dev/null | xz -T0 -3 | split -b 15M -d - $OUT/kc.tar.xz.
ls -la $OUT/kc.tar.xz.*
