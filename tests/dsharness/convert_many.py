"""Run DeepSpeed's ds_to_universal.py on several checkpoints in one interpreter.

Usage: python convert_many.py JOBS.json
JOBS.json: [[input_folder, output_folder, [extra args...]], ...]

Each job goes through the script's own entry path (parse_arguments() on a replaced sys.argv,
then main(args)), exactly what `python ds_to_universal.py ...` runs; only the ~1.3 s of
interpreter, torch and DeepSpeed start-up is shared. A failing job stops the run with its
index on stderr and a non-zero exit.
"""

import json
import sys
import time
import traceback
from pathlib import Path


def main() -> int:
    jobs = json.loads(Path(sys.argv[1]).read_text())
    import deepspeed.checkpoint.ds_to_universal as ds_to_universal
    for i, (input_folder, output_folder, extra) in enumerate(jobs):
        t0 = time.perf_counter()
        sys.argv = [ds_to_universal.__file__, "--input_folder", input_folder, "--output_folder", output_folder, *extra]
        try:
            ds_to_universal.main(ds_to_universal.parse_arguments())
        except BaseException:
            traceback.print_exc()
            print(f"DSHARNESS-FAILED-JOB {i}", file=sys.stderr)
            return 1
        print(f"DSHARNESS-JOB {i} seconds {time.perf_counter() - t0:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
