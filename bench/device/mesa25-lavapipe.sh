#!/usr/bin/env bash
# Run a Python command on Debian 13's lavapipe (Mesa 25, LLVM 19) on a Debian 12 box -- a second driver to
# tell a lavapipe bug from kvflash's or ggml's (issue 39: bench/device/vk_heap_repro.py crashes Debian 12's
# Mesa 22.3.6 and runs clean here).  An experiment, not CI: nothing is installed, the system stays as it is.
#
#   bench/device/mesa25-lavapipe.sh ROOT PYTHON ARGS...
#   e.g. bench/device/mesa25-lavapipe.sh /tmp/trixie-root .venv/bin/python bench/device/vk_heap_repro.py M.gguf
#
# The first run fetches mesa-vulkan-drivers and what it depends on from the trixie suite (apt with a private
# state, from the system's own Debian mirror and keyring) and unpacks them with dpkg -x into ROOT.  The
# command then runs under trixie's dynamic loader and glibc (Mesa 25 needs glibc >= 2.39; Debian 12 has
# 2.36), with trixie's libraries first and the system's after them, the ICD pointed at ROOT's lavapipe, and
# the venv's site-packages on PYTHONPATH (the interpreter is started by the loader, not by the venv's
# symlink).  GGML_VK_VISIBLE_DEVICES=0 is set: ggml-vulkan skips CPU devices otherwise.
set -euo pipefail
ROOT=$1; PY=$2; shift 2
LIB=$ROOT/usr/lib/x86_64-linux-gnu
if [ ! -f "$LIB/libvulkan_lvp.so" ]; then
  APT=$(mktemp -d /tmp/kvflash-trixie-mesa.XXXXXX)
  mkdir -p "$APT/lists/partial" "$APT/cache/archives/partial" "$APT/debs"
  mirror=$({ cat /etc/apt/sources.list /etc/apt/sources.list.d/* 2>/dev/null || true; } |
           awk '/^[[:space:]]*(URIs:|deb[[:space:]])/ { for (i = 1; i <= NF; i++) if ($i ~ /^https?:\/\/.*\/debian\/?$/) { print $i; exit } }')
  [ -n "$mirror" ] || { echo "no Debian mirror found in the system's apt sources" >&2; exit 1; }
  echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] ${mirror%/} trixie main" > "$APT/sources.list"
  opts=(-o "Dir::Etc::SourceList=$APT/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
        -o "Dir::State::Lists=$APT/lists" -o "Dir::Cache=$APT/cache" -o "APT::Get::List-Cleanup=0"
        -o "APT::Sandbox::User=root")
  apt-get "${opts[@]}" update -q >/dev/null
  pkgs=$(apt-cache "${opts[@]}" depends --recurse --no-recommends --no-suggests --no-conflicts --no-breaks \
         --no-replaces --no-enhances mesa-vulkan-drivers/trixie libvulkan1/trixie | grep '^[a-z0-9]' | sort -u)
  ( cd "$APT/debs" && for p in $pkgs; do apt-get "${opts[@]}" download "$p/trixie" >/dev/null 2>&1 || true; done )
  mkdir -p "$ROOT"
  for d in "$APT"/debs/*.deb; do dpkg -x "$d" "$ROOT"; done
  rm -rf "$APT"
  [ -f "$LIB/libvulkan_lvp.so" ] || { echo "no libvulkan_lvp.so in trixie's mesa-vulkan-drivers" >&2; exit 1; }
fi
ICD=$ROOT/lvp_icd.json
printf '{"file_format_version": "1.0.0", "ICD": {"library_path": "%s", "api_version": "1.4.305"}}\n' \
  "$LIB/libvulkan_lvp.so" > "$ICD"
# the real interpreter behind a venv's symlink, its libpython's folder, and the venv's packages
REAL=$(readlink -f "$PY")
PYLIB=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))')
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
export VK_ICD_FILENAMES=$ICD VK_DRIVER_FILES=$ICD GGML_VK_VISIBLE_DEVICES=${GGML_VK_VISIBLE_DEVICES:-0}
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
exec "$LIB/ld-linux-x86-64.so.2" --library-path "$LIB:$PYLIB:/usr/lib/x86_64-linux-gnu:/lib/x86_64-linux-gnu" "$REAL" "$@"
