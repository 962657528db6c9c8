"""The node provider of tests/test_autoscaling.py's fake cloud: Ray's fake multi-node provider (worker "machines" are
raylets on this machine), except that each node unpacks runtime environments (a job's --working-dir) into a folder
of its own, as each machine of a cloud does on its own disk. In the one folder Ray's fake nodes share, a node's
first use of a job's working_dir deletes and unpacks it again (Ray's working_dir plugin overwrites) under the
processes of the other nodes that run in it: the job's driver and Tune's trial actors on the head then fail at
os.getcwd(). The autoscaler loads this class by name (provider type "external"), in its own process."""
import functools
import itertools
from unittest import mock

import ray._private.parameter
from ray.autoscaler._private.fake_multi_node.node_provider import FakeMultiNodeProvider

_disks = itertools.count(1)


class SeparateDisks(FakeMultiNodeProvider):
    def _create_node_with_resources_and_labels(self, node_config, tags, count, resources, labels):
        own = functools.partial(ray._private.parameter.RayParams, runtime_env_dir_name=f"runtime_env_{next(_disks)}")
        with mock.patch.object(ray._private.parameter, "RayParams", own):  # what the fake provider builds a node from
            super()._create_node_with_resources_and_labels(node_config, tags, count, resources, labels)
