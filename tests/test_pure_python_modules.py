"""The scheduler and KV-cache modules must import with torch (and numpy) made unimportable."""

import subprocess
import sys

CODE = r"""
import sys

class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'numpy'):
            raise ImportError(f'{name} is blocked in this test')
        return None

sys.meta_path.insert(0, Block())
import octavo.scheduler, octavo.limits, octavo.policies, octavo.kv_cache, octavo.kv_cache.manager, octavo.kv_cache.block_pool
import octavo.kv_cache.prefix_cache, octavo.kv_cache.tier, octavo.kv_cache.groups, octavo.kv_cache.connector
import octavo.kv_cache.pins, octavo.kv_cache.view, octavo.kv_cache.costs, octavo.sampling.verify, octavo.spec_decode.controller, octavo.request, octavo.sampling.params, octavo.request_queue
import octavo.outputs, octavo.config, octavo.planner, octavo.metrics, octavo.sampling.logprobs, octavo.cpu_features
import octavo.structured.schema, octavo.server.tools, octavo.server.parsers.tool_calls, octavo.server.parsers.reasoning
import octavo.server.parsers.turn, octavo.pooling
import octavo.simulator.simulator, octavo.simulator.workload, octavo.spec_decode
from octavo import SamplingParams
assert 'torch' not in sys.modules and 'numpy' not in sys.modules
print('ok')
"""


def test_scheduler_and_kv_cache_import_without_torch():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_the_blocker_really_blocks_torch():
    code = CODE.replace("import octavo.scheduler", "import torch\nimport octavo.scheduler")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode != 0 and "blocked in this test" in out.stderr
