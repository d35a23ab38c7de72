"""A script that ends as many do, in ``sys.exit(main())``, after its ranks have talked (an all-reduce).

    nbtrain run sys_exit_main.py --processes 2 -- FORM    # FORM 0, None or bare: sys.exit(0), (None) or ()
"""

import sys

import torch
import torch.distributed as dist


def main():
    total = torch.ones(1)
    dist.all_reduce(total)
    print(f"rank {dist.get_rank()} of {int(total.item())} done", flush=True)
    return 0 if form == "0" else None


form = sys.argv[1]
if __name__ == "__main__":
    if form == "bare":
        main()
        sys.exit()
    sys.exit(main())
