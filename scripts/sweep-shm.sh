#!/usr/bin/env bash
# Removes what Triton Python-backend stubs of a tritonserver that is gone leave behind. Run before
# starting tritonserver.
# - Stubs of this repository's models whose parent is no tritonserver: a stub started while its
#   server died (stopped or killed while it loaded its models) never gets its initialize message,
#   and a 2.51 stub waits for it for ever (the models' own watcher, backend/triton_utils.py, starts
#   in initialize), holding its memory and its region. Killed.
# - Their shared-memory regions: a stub or a tritonserver killed (SIGKILL, OOM, a crash; the
#   supervisor's restarts) leaves its region in /dev/shm for good: a container's /dev/shm is 64 MiB
#   by default, and a tritonserver restarted in it again and again would fill it, then fail to
#   start its stubs. A region still mapped by a process, or younger than a minute (one being
#   created), stays.
set -u
dir=${SHM_DIR:-/dev/shm}
repo=$(cd "$(dirname "$0")/.." && pwd)
repo_real=$(cd "$repo" && pwd -P)

orphans=()
for status in /proc/[0-9]*/status; do
  pid=${status#/proc/}
  pid=${pid%/status}
  # Builtins only up to here: this runs for every process on the host.
  read -r comm <"/proc/$pid/comm" 2>/dev/null || continue
  [ "$comm" = triton_python_b ] || continue # the stub, as the kernel names it
  mapfile -d '' -t argv <"/proc/$pid/cmdline" 2>/dev/null || continue
  # The stub's first argument is its model.py as tritonserver was given the repository: relative
  # to their working directory under `tritonserver --model-repository model_repository`.
  model=""
  for ((i = 0; i + 1 < ${#argv[@]}; i++)); do
    case "${argv[i]}" in *triton_python_backend_stub) model=${argv[i + 1]} && break ;; esac
  done
  case "$model" in "") continue ;; /*) ;; *) model="$(readlink "/proc/$pid/cwd" 2>/dev/null)/$model" ;; esac
  case "$model" in "$repo/model_repository/"* | "$repo_real/model_repository/"*) ;; *) continue ;; esac
  ppid=$(sed -n 's/^PPid:[[:space:]]*//p' "$status" 2>/dev/null)
  parent=""
  read -r parent <"/proc/$ppid/comm" 2>/dev/null
  [ "$parent" = tritonserver ] && continue
  kill -9 "$pid" 2>/dev/null && orphans+=("$pid")
done
if [ "${#orphans[@]}" -gt 0 ]; then
  echo "sweep-shm: killed ${#orphans[@]} Triton stub(s) whose tritonserver is gone: ${orphans[*]}" >&2
  for _ in $(seq 20); do # their mappings go with them
    alive=0
    for pid in "${orphans[@]}"; do grep -q . "/proc/$pid/maps" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && break
    sleep 0.05
  done
fi

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
