#!/usr/bin/env bash
# Install the tgw broker as a systemd service, idempotently.
#
#   sudo scripts/install-service.sh [--dry-run] [--root DIR] [--skip-venv] [--python PY]
#
# Steps, each one printed with what it did, or "unchanged" / "skipped (why)":
#   group, user  system group and user `tgw` (no login shell, home /var/lib/tgw, not created),
#                only if missing; an existing user is left as it is.
#   gpu-access   if /dev/nvidia* exist and are not world-accessible, add tgw to their group
#                (`video` on some distros). Root-only nodes are reported, not changed.
#   venv         /opt/tgw/.venv with tgw[server] from this checkout (not editable). torch is
#                pinned to 2.13.0 as in scripts/setup-venv.sh and installed only when the venv
#                has none: on a GPU box, install the CUDA build of torch==2.13.0 into
#                /opt/tgw/.venv first; a different torch version stops the script, nothing is
#                replaced. A stamp (/opt/tgw/.venv/.tgw-source, a hash of the package sources)
#                makes a re-run skip the pip install when the checkout has not changed.
#   state-dirs   /var/lib/tgw (0750 tgw:tgw, the unit's StateDirectory), snapshots/ in it
#                (0750 tgw:tgw) and models/ (0755 root:root: the service reads, cannot write).
#   demo-models  only while /etc/tgw/tgw.yaml does not exist yet: `python -m
#                tgw.workers.demo_models /var/lib/tgw/models` builds mlp, resnet and embed
#                locally (nothing is downloaded), so the first config has real models to serve.
#   config       /etc/tgw/tgw.yaml, written only if absent (an operator's config is never
#                touched): the three demo models with absolute paths, the socket
#                ipc:///run/tgw/tgw.sock. A config needs at least one model and the unit runs
#                `tgw-broker check-config` before every start, so an empty one would not do.
#   check-config the config as the service user would read it (root / only).
#   unit         scripts/systemd/tgw-broker.service -> /etc/systemd/system/, replaced when it
#                differs (local changes belong in a drop-in: `systemctl edit tgw-broker`).
#   systemd      `systemctl daemon-reload` when the unit changed and systemd is running; the
#                service is never enabled or started: the command to do so is printed.
#
# --dry-run     print every action, change nothing (no root needed).
# --root DIR    (or TGW_INSTALL_ROOT=DIR) install the files under DIR instead of / (an image
#               tree, or a test): user/group, GPU groups and daemon-reload are skipped, and so
#               are file owners (systemd's StateDirectory= chowns /var/lib/tgw to tgw at first
#               start); the venv is skipped too, because a venv only works at the absolute path
#               it was created at. The paths written inside files are those of the target (/).
# --skip-venv   leave /opt/tgw/.venv alone (you manage it).
# --python PY   python with tgw and torch to build the demo models (default: the venv's).
set -euo pipefail
umask 022

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SERVICE_USER=tgw
VENV=/opt/tgw/.venv
CONFIG_DIR=/etc/tgw
CONFIG=$CONFIG_DIR/tgw.yaml
STATE_DIR=/var/lib/tgw
SNAPSHOT_DIR=$STATE_DIR/snapshots
MODEL_DIR=$STATE_DIR/models
DEMO_MODELS=(mlp-v1.pt resnet-v1.pt embed-v1.pt)  # what tgw.workers.demo_models writes
UNIT_SRC=$REPO/scripts/systemd/tgw-broker.service
UNIT_DEST=/etc/systemd/system/tgw-broker.service
TORCH_VERSION=2.13.0

DRY_RUN=0
SKIP_VENV=0
ROOT=${TGW_INSTALL_ROOT:-/}
R=""            # prefix of every target path: empty for /, else ROOT
DEMO_PYTHON=""
CHANGES=0       # actions taken (or, in a dry run, that would be)
UNIT_CHANGED=0
STEP=setup      # the step that say and act report under

die() { echo "install-service: error: $*" >&2; exit 1; }
say() { echo "install-service: $STEP: $*"; }

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }

parse_args() {
    while [ $# -gt 0 ]; do
        case $1 in
            --dry-run) DRY_RUN=1 ;;
            --skip-venv) SKIP_VENV=1 ;;
            --root) [ $# -ge 2 ] || die "--root needs a directory"; ROOT=$2; shift ;;
            --root=*) ROOT=${1#--root=} ;;
            --python) [ $# -ge 2 ] || die "--python needs a path"; DEMO_PYTHON=$2; shift ;;
            --python=*) DEMO_PYTHON=${1#--python=} ;;
            -h|--help) usage; exit 0 ;;
            *) die "unknown argument $1 (see --help)" ;;
        esac
        shift
    done
    ROOT=$(realpath -m -- "$ROOT")
    [ "$ROOT" = / ] || R=$ROOT
    if [ -z "$R" ] && [ "$DRY_RUN" = 0 ] && [ "$(id -u)" != 0 ]; then
        die "installing under / needs root (or use --dry-run, or --root DIR)"
    fi
}

# The target path of an absolute path on the installed system.
t() { printf '%s%s' "$R" "$1"; }

# Every change goes through act: in a dry run it is only printed.
act() {
    local what=$1; shift
    CHANGES=$((CHANGES + 1))
    if [ "$DRY_RUN" = 1 ]; then say "would $what"; return 0; fi
    say "$what"
    "$@"
}

quoted() { local out; printf -v out '%q ' "$@"; printf '%s' "${out% }"; }
run_cmd() { act "run: $(quoted "$@")" "$@"; }

user_exists() { getent passwd "$SERVICE_USER" >/dev/null; }
owners_managed() { [ -z "$R" ]; }

# ---- user and group -----------------------------------------------------------------------
step_group() {
    STEP=group
    if [ -n "$R" ]; then say "skipped (--root $R: users belong to the target system)"; return; fi
    if getent group "$SERVICE_USER" >/dev/null; then say "unchanged (group $SERVICE_USER exists)"; return; fi
    run_cmd groupadd --system "$SERVICE_USER"
}

step_user() {
    STEP=user
    if [ -n "$R" ]; then say "skipped (--root $R)"; return; fi
    if user_exists; then say "unchanged (user $SERVICE_USER exists, uid $(id -u "$SERVICE_USER"); left as it is)"; return; fi
    local nologin
    nologin=$(command -v nologin || echo /usr/sbin/nologin)
    # No home is created: HOME points at the state directory (CUDA's kernel cache, ~/.cache).
    run_cmd useradd --system --gid "$SERVICE_USER" --home-dir "$STATE_DIR" --no-create-home \
        --shell "$nologin" --comment "tgw inference gateway" "$SERVICE_USER"
}

# /dev/nvidia* are usually 0666; some distros make them 0660 root:video (NVreg_DeviceFileGID).
step_gpu_access() {
    STEP=gpu-access
    if [ -n "$R" ]; then say "skipped (--root $R: this machine's devices are not the target's)"; return; fi
    local dev group mode groups_needed=() g
    for dev in /dev/nvidiactl /dev/nvidia-uvm /dev/nvidia[0-9]*; do
        [ -c "$dev" ] || continue
        mode=$(stat -c %a "$dev"); group=$(stat -c %G "$dev")
        if (( (8#$mode & 8#006) == 8#006 )); then continue; fi
        if [ "$group" = root ]; then
            say "warning: $dev is $mode root:root, tgw cannot open it (set the driver's NVreg_DeviceFileMode/NVreg_DeviceFileGID)"
            continue
        fi
        [[ " ${groups_needed[*]} " == *" $group "* ]] || groups_needed+=("$group")
    done
    if ! compgen -G "/dev/nvidia*" >/dev/null; then say "unchanged (no NVIDIA devices)"; return; fi
    if [ ! -e /dev/nvidia-uvm ]; then
        say "warning: /dev/nvidia-uvm is missing; CUDA needs it and the unit (NoNewPrivileges) cannot create it: run 'nvidia-modprobe -u -c0' at boot"
    fi
    if [ ${#groups_needed[@]} = 0 ]; then say "unchanged (the devices are world-accessible)"; return; fi
    for g in "${groups_needed[@]}"; do
        if user_exists && id -nG "$SERVICE_USER" | tr ' ' '\n' | grep -qx "$g"; then
            say "unchanged ($SERVICE_USER is in group $g)"
        else
            run_cmd usermod -aG "$g" "$SERVICE_USER"
        fi
    done
}

# ---- venv ---------------------------------------------------------------------------------
# Hash of what `pip install <repo>` would install: a changed checkout means a reinstall.
source_hash() {
    (cd "$REPO" && find pyproject.toml broker workers shm client bench -type f \
        \( -name '*.py' -o -name pyproject.toml \) -not -path '*/__pycache__/*' -print0 \
        | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1)
}

# Atomic replace: a reader never sees half a file.
write_file() {  # DEST MODE CONTENT
    local tmp
    tmp=$(mktemp "$1.XXXXXX")
    printf '%s' "$3" >"$tmp"
    chmod "$2" "$tmp"
    mv -f "$tmp" "$1"
}

copy_file() {  # SRC DEST MODE: byte for byte, atomic
    local tmp
    tmp=$(mktemp "$2.XXXXXX")
    cp "$1" "$tmp"
    chmod "$3" "$tmp"
    mv -f "$tmp" "$2"
}

# The interpreter the venv is built on: the system's, not a user's pyenv or conda.
base_python() {
    if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"
    elif [ -x /usr/bin/python3 ]; then echo /usr/bin/python3
    else command -v python3 || die "no python3 found (set PYTHON=...)"
    fi
}

# ProtectHome=yes hides /home, /root and /run/user from the service: a venv whose interpreter
# lives there would install fine and then fail to start.
check_reachable() {  # PYTHON
    local real msg
    real=$("$1" -c 'import os, sys; print(os.path.realpath(sys.executable))') || die "cannot run $1"
    case $real in
        /home/*|/root/*|/run/user/*)
            msg="$1 is $real, which the service cannot run (ProtectHome=yes); use PYTHON=/usr/bin/python3 or an interpreter under /usr or /opt"
            if [ "$DRY_RUN" = 1 ]; then say "warning: $msg"; else die "$msg"; fi ;;
    esac
}

step_venv() {
    STEP=venv
    if [ "$SKIP_VENV" = 1 ]; then say "skipped (--skip-venv): $VENV is yours to manage"; return; fi
    if [ -n "$R" ]; then say "skipped (--root $R: a venv only works at the path it was made at; build it on the target)"; return; fi
    local py=$VENV/bin/python pip=("$VENV/bin/pip" install --disable-pip-version-check) version
    if [ -x "$py" ]; then
        check_reachable "$py"
        say "unchanged ($VENV exists)"
    else
        check_reachable "$(base_python)"
        run_cmd "$(base_python)" -m venv "$VENV"
    fi
    if [ -x "$py" ] && version=$("$py" -c 'import torch; print(torch.__version__)' 2>/dev/null); then
        # 2.13.0+cu128 (a CUDA build) is 2.13.0 for pip and for us.
        [ "${version%%+*}" = "$TORCH_VERSION" ] \
            || die "$VENV has torch $version; tgw needs torch==$TORCH_VERSION. Not replacing it: install torch==$TORCH_VERSION (the CUDA build on a GPU box) into $VENV, then re-run"
        say "unchanged (torch $version)"
    else
        run_cmd "${pip[@]}" "torch==$TORCH_VERSION"
    fi
    local stamp=$VENV/.tgw-source hash
    hash=$(source_hash)
    if [ -x "$py" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$hash" ] \
        && "$py" -c 'import tgw.broker, tgw.workers' 2>/dev/null; then
        say "unchanged (tgw from $REPO installed, sources unchanged)"
        return
    fi
    # Not editable: the service must not depend on this checkout staying where it is.
    run_cmd "${pip[@]}" "${REPO}[server]"
    act "check the imports, record the sources' hash in $stamp" record_install "$py" "$stamp" "$hash"
}

record_install() {  # PYTHON STAMP HASH
    "$1" -c 'import tgw.client, tgw.broker, tgw.workers, torch' || die "$VENV: installation incomplete"
    write_file "$2" 0644 "$3"$'\n'
}

# ---- directories, models, config ----------------------------------------------------------
ensure_dir() {  # PATH MODE OWNER:GROUP
    local path=$1 mode=$2 owner=$3 target changed=0
    target=$(t "$path")
    if [ ! -d "$target" ]; then
        if owners_managed; then
            run_cmd install -d -m "$mode" -o "${owner%:*}" -g "${owner#*:}" "$target"
        else
            run_cmd install -d -m "$mode" "$target"
        fi
        return
    fi
    if [ "$(stat -c %a "$target")" != "${mode#0}" ]; then run_cmd chmod "$mode" "$target"; changed=1; fi
    if owners_managed && [ "$(stat -c %U:%G "$target")" != "$owner" ]; then
        run_cmd chown "$owner" "$target"; changed=1
    fi
    [ "$changed" = 1 ] || say "unchanged ($target)"
}

step_state_dirs() {
    STEP=state-dirs
    owners_managed || say "note: owners are not set under --root (systemd's StateDirectory= gives $STATE_DIR to $SERVICE_USER at first start)"
    ensure_dir "$STATE_DIR" 0750 "$SERVICE_USER:$SERVICE_USER"
    ensure_dir "$SNAPSHOT_DIR" 0750 "$SERVICE_USER:$SERVICE_USER"
    ensure_dir "$MODEL_DIR" 0755 root:root
}

step_demo_models() {
    STEP=demo-models
    if [ -e "$(t "$CONFIG")" ]; then
        say "skipped ($(t "$CONFIG") exists: it decides which models are served)"
        return
    fi
    local f missing=0
    for f in "${DEMO_MODELS[@]}"; do [ -f "$(t "$MODEL_DIR/$f")" ] || missing=1; done
    if [ "$missing" = 0 ]; then say "unchanged (${DEMO_MODELS[*]} in $(t "$MODEL_DIR"))"; return; fi
    local py=${DEMO_PYTHON:-$(t "$VENV")/bin/python}
    # Dry runs stop here too, unless this run's venv step would create the venv.
    if [ ! -x "$py" ] && { [ "$DRY_RUN" = 0 ] || [ -n "$DEMO_PYTHON" ] || [ -n "$R" ] || [ "$SKIP_VENV" = 1 ]; }; then
        die "no python to build the demo models ($py missing): pass --python PY (one with tgw and torch)"
    fi
    act "run: $(quoted "$py" -m tgw.workers.demo_models "$(t "$MODEL_DIR")")" \
        build_demo_models "$py" "$(t "$MODEL_DIR")"
}

# The module prints the models' declarations as JSON; demo_config spells them out (a test
# checks the two agree).
build_demo_models() { "$1" -m tgw.workers.demo_models "$2" >/dev/null; }

demo_config() {
    cat <<EOF
# tgw broker configuration, written once by scripts/install-service.sh (a re-run never
# overwrites it). It serves the demo models built in $MODEL_DIR: replace them with
# your own TorchScript models. configs/example.yaml in the tgw checkout annotates every key;
# relative model paths are resolved from this file's directory.
#   check:  sudo -u $SERVICE_USER $VENV/bin/tgw-broker check-config $CONFIG
#   apply:  sudo systemctl restart tgw-broker
server:
  # Keep ipc:// sockets under /run/tgw (the unit's RuntimeDirectory, the only runtime
  # directory the service may write); callers need group $SERVICE_USER to connect.
  address: ipc:///run/tgw/tgw.sock
workers:
  devices: auto          # one worker per CUDA device, else one CPU worker
  threads_per_worker: 1
model_roots: [$MODEL_DIR/]   # model files (and runtime loads) must lie in here
models:
  - name: mlp
    versions:
      - version: "1"
        path: $MODEL_DIR/mlp-v1.pt
    inputs:
      - {name: x, dtype: float32, shape: [256]}
    outputs:
      - {name: y, dtype: float32, shape: [10]}
    max_batch_size: 64
    warmup_batch_sizes: [1, 64]
  - name: resnet
    versions:
      - version: "1"
        path: $MODEL_DIR/resnet-v1.pt
    inputs:
      - {name: image, dtype: float32, shape: [3, 64, 64]}
    outputs:
      - {name: logits, dtype: float32, shape: [1000]}
    max_batch_size: 32
    warmup_batch_sizes: [1, 32]
  - name: embed
    versions:
      - version: "1"
        path: $MODEL_DIR/embed-v1.pt
    inputs:
      - {name: tokens, dtype: int64, shape: [-1]}
    outputs:
      - {name: embedding, dtype: float32, shape: [32]}
      - {name: length, dtype: int64, shape: []}
    max_batch_size: 32
    warmup_batch_sizes: [1, 32]
EOF
}

# A hard link of a finished temporary file: atomic, and it fails instead of replacing a
# config that appeared meanwhile.
write_new_file() {  # DEST MODE CONTENT
    local tmp
    tmp=$(mktemp "$1.XXXXXX")
    printf '%s' "$3" >"$tmp"
    chmod "$2" "$tmp"
    ln "$tmp" "$1" || { rm -f "$tmp"; return 1; }
    rm -f "$tmp"
}

step_config() {
    STEP=config
    ensure_dir "$CONFIG_DIR" 0755 root:root
    if [ -e "$(t "$CONFIG")" ]; then say "unchanged ($(t "$CONFIG") exists: kept as it is, never overwritten)"; return; fi
    act "write $(t "$CONFIG") (mode 0644): serve the demo models in $MODEL_DIR" \
        write_new_file "$(t "$CONFIG")" 0644 "$(demo_config)"$'\n'
}

# Read-only: the file must pass the check the unit runs before every start.
step_check_config() {
    STEP=check-config
    local broker=$VENV/bin/tgw-broker
    if [ -n "$R" ]; then say "skipped (--root $R: the config's paths are the target's)"; return; fi
    if [ "$DRY_RUN" = 1 ]; then say "would check $CONFIG as $SERVICE_USER with $broker (read-only)"; return; fi
    [ -x "$broker" ] || { say "skipped ($broker missing)"; return; }
    local as_user=() out
    command -v runuser >/dev/null && as_user=(runuser -u "$SERVICE_USER" --)
    out=$(cd / && "${as_user[@]}" "$broker" check-config "$CONFIG" 2>&1) \
        || die "$CONFIG does not pass check-config, the service would not start:"$'\n'"$out"
    say "ok (${as_user:+as $SERVICE_USER: }$out)"
}

# ---- unit and systemd ---------------------------------------------------------------------
step_unit() {
    STEP=unit
    local dest
    dest=$(t "$UNIT_DEST")
    if cmp -s "$UNIT_SRC" "$dest"; then say "unchanged ($dest is the checkout's)"; return; fi
    [ -d "$(dirname "$dest")" ] || run_cmd install -d -m 0755 "$(dirname "$dest")"
    local verb=install
    [ -e "$dest" ] && verb="replace (differs from the checkout's)"
    act "$verb $dest" copy_file "$UNIT_SRC" "$dest" 0644
    UNIT_CHANGED=1
}

systemd_running() { [ -d /run/systemd/system ]; }  # what sd_booted() checks: PID 1 is systemd

step_systemd() {
    STEP=systemd
    if [ -n "$R" ]; then say "skipped (--root $R: no daemon-reload)"; return; fi
    if ! systemd_running; then say "skipped (systemd is not PID 1 here: no daemon-reload)"; return; fi
    if [ "$UNIT_CHANGED" = 0 ] && [ "$DRY_RUN" = 0 ] \
        && [ "$(systemctl show -p NeedDaemonReload --value tgw-broker.service 2>/dev/null)" != yes ]; then
        say "unchanged (systemd has the current unit loaded)"
        return
    fi
    if [ "$UNIT_CHANGED" = 0 ] && [ "$DRY_RUN" = 1 ]; then say "unchanged (unit unchanged: no daemon-reload)"; return; fi
    run_cmd systemctl daemon-reload
}

main() {
    parse_args "$@"
    [ -f "$UNIT_SRC" ] || die "$UNIT_SRC missing"
    [ "$DRY_RUN" = 1 ] && echo "install-service: dry run: nothing will be changed"
    echo "install-service: installing from $REPO into root $ROOT"
    step_group
    step_user
    step_gpu_access
    step_venv
    step_state_dirs
    step_demo_models
    step_config
    step_check_config
    step_unit
    step_systemd
    if [ "$DRY_RUN" = 1 ]; then
        echo "install-service: dry run: $CHANGES change(s) would be made; nothing was changed"
    elif [ "$CHANGES" = 0 ]; then
        echo "install-service: nothing to change"
    else
        echo "install-service: $CHANGES change(s) made"
    fi
    if [ -z "$R" ]; then
        echo "install-service: to start the service now and at boot: sudo systemctl enable --now tgw-broker"
    fi
}

main "$@"
