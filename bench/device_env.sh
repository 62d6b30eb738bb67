# Sourced by bench/run_*_profile_device.sh: the carried build ($CARRY, default .devcarry/new), the folder whose
# files come back ($OUT), the library path, and the 4-layer V4-Flash cut's model arguments (MODEL).
CARRY=${CARRY:-.devcarry/new}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export LD_LIBRARY_PATH="$CARRY:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
MODEL=(--model bench/configs/v4_flash_4layer.json --load-format dummy --device cuda)
