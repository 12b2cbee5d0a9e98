"""Remove what a killed fault-lab run left behind: namespaces and cgroups named `mapplab-*`.

python -m megatronapp.faultlab.cleanup
"""

from megatronapp.faultlab.cpu import cleanup_cgroups
from megatronapp.faultlab.net import cleanup_namespaces

if __name__ == "__main__":
    for name in cleanup_namespaces() + cleanup_cgroups():
        print(f"removed {name}")
