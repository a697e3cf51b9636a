#!/usr/bin/env bash
# What a KVFLASH_VULKAN=ON build needs on Debian 12 (issue 39), installed from Debian's own packages:
#   - Mesa's Vulkan drivers (lavapipe: Vulkan on the CPU), the loader, glslc (ggml-vulkan's shader
#     compiler), SPIRV-Headers (its CMake config: ggml-vulkan finds it) and vulkaninfo;
#   - Vulkan headers new enough for the pinned ggml-vulkan: Debian 12's (1.3.239) lack what it uses
#     (vk::LayerSettingEXT), so Debian 13's libvulkan-dev is
#     fetched with apt from the trixie suite into a private apt state and unpacked with dpkg -x (its
#     headers are what the build reads), into PREFIX; nothing of trixie is installed and the system's apt sources stay as they are.
#
#   bash .ci/vulkan-deps.sh [PREFIX]      # PREFIX default: ~/.cache/kvflash/vulkan-headers
# Prints the include directory to pass as -DVulkan_INCLUDE_DIR=... (the last line of its output).
set -euo pipefail
PREFIX=${1:-${KVFLASH_CACHE:-$HOME/.cache/kvflash}/vulkan-headers}
export DEBIAN_FRONTEND=noninteractive

need=()
for p in mesa-vulkan-drivers libvulkan-dev glslc spirv-headers vulkan-tools; do
  dpkg -s "$p" >/dev/null 2>&1 || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
  apt-get install -y -q "${need[@]}" >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q "${need[@]}" >/dev/null; }
  echo "installed: ${need[*]}" >&2
fi

if [ ! -f "$PREFIX/usr/include/vulkan/vulkan.hpp" ]; then
  APT=$(mktemp -d /tmp/kvflash-trixie.XXXXXX)
  mkdir -p "$APT/lists/partial" "$APT/cache/archives/partial" "$APT/debs"
  # trixie from the same mirror and keyring as the system's own sources
  # (the first Debian archive URI of a line in use: deb822 "URIs:" or a one-line "deb", comments skipped)
  mirror=$({ cat /etc/apt/sources.list /etc/apt/sources.list.d/* 2>/dev/null || true; } |
           awk '/^[[:space:]]*(URIs:|deb[[:space:]])/ { for (i = 1; i <= NF; i++) if ($i ~ /^https?:\/\/.*\/debian\/?$/) { print $i; exit } }')
  [ -n "$mirror" ] || { echo "no Debian mirror found in the system's apt sources" >&2; exit 1; }
  keyring=/usr/share/keyrings/debian-archive-keyring.gpg
  echo "deb [signed-by=$keyring] ${mirror%/} trixie main" > "$APT/sources.list"
  opts=(-o "Dir::Etc::SourceList=$APT/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
        -o "Dir::State::Lists=$APT/lists" -o "Dir::Cache=$APT/cache" -o "APT::Get::List-Cleanup=0"
        -o "APT::Sandbox::User=root")
  apt-get "${opts[@]}" update -q >/dev/null
  pkgs=(libvulkan-dev/trixie)   # trixie's carries the headers (vulkan.h, vulkan.hpp) itself
  ( cd "$APT/debs" && apt-get "${opts[@]}" download "${pkgs[@]}" >/dev/null )
  mkdir -p "$PREFIX"
  for d in "$APT"/debs/*.deb; do dpkg -x "$d" "$PREFIX"; done
  rm -rf "$APT"
  [ -f "$PREFIX/usr/include/vulkan/vulkan.hpp" ] || { echo "no vulkan.hpp in trixie's packages (${pkgs[*]})" >&2; exit 1; }
  echo "trixie's Vulkan headers in $PREFIX: $(grep -m1 -oE 'VK_HEADER_VERSION [0-9]+' "$PREFIX/usr/include/vulkan/vulkan_core.h")" >&2
fi
echo "$PREFIX/usr/include"
