#!/usr/bin/env bash
# Removes the shared-memory regions of Triton Python-backend stubs that are gone. A stub or a
# tritonserver killed (SIGKILL, OOM, a crash; the supervisor's restarts) leaves its region in
# /dev/shm for good: a container's /dev/shm is 64 MiB by default, and a tritonserver restarted in
# it again and again would fill it, then fail to start its stubs. A region still mapped by a
# process, or younger than a minute (one being created), stays. Run before starting tritonserver.
set -u
dir=${SHM_DIR:-/dev/shm}
mapped=$(cat /proc/[0-9]*/maps 2>/dev/null | grep -o "$dir/triton_python_backend_shm_region_[^ ]*" | sort -u)
removed=0
while IFS= read -r region; do
  [ -n "$region" ] || continue
  grep -qxF -- "$region" <<<"$mapped" && continue
  rm -f -- "$region" 2>/dev/null && removed=$((removed + 1))
done < <(find "$dir" -maxdepth 1 -name 'triton_python_backend_shm_region_*' -mmin +1 2>/dev/null)
if [ "$removed" -gt 0 ]; then
  echo "sweep-shm: removed $removed shared-memory region(s) of Triton stubs that are gone" >&2
fi
exit 0
