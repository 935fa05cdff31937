#!/usr/bin/env bash
# The old name of benchmarks/accelerator_check.sh (same flags), kept so old instructions work.
exec "$(dirname "${BASH_SOURCE[0]}")/accelerator_check.sh" "$@"
