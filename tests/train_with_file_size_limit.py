"""train.py, where rank 1 cannot write a file larger than a few KiB from its second checkpoint on,
as on a full disk or a quota: RLIMIT_FSIZE makes a write past the limit fail with EFBIG (CPython
ignores the SIGXFSZ that comes with it). tests/test_bad_input.py runs it under torchrun:

    torchrun --nproc_per_node=2 tests/train_with_file_size_limit.py <train.py's arguments>
"""

import os
import resource
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import checkpoint  # noqa: E402
import train  # noqa: E402

LIMIT_BYTES = 4096
_save, _saves = checkpoint.save, []


def save_with_a_limit_from_the_second(*args, **kwargs):
    _saves.append(None)
    if len(_saves) == 2 and os.environ.get("RANK") == "1":
        resource.setrlimit(
            resource.RLIMIT_FSIZE, (LIMIT_BYTES, resource.getrlimit(resource.RLIMIT_FSIZE)[1])
        )
    return _save(*args, **kwargs)


checkpoint.save = save_with_a_limit_from_the_second

if __name__ == "__main__":
    train.run_script(train.main, sys.argv[1:])  # as train.py ends
