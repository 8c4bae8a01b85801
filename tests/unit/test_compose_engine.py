"""The compose tests' engine helper: what a killed dockerd left mounted is found, deepest first, and nothing else."""

from pathlib import Path

from tests.compose.engine import mount_points_under

MOUNTINFO = """\
22 1 252:0 / / rw,relatime - ext4 /dev/vda rw
90 22 252:0 /var/cache/pdcluster-docker/data /var/cache/pdcluster-docker/data rw - ext4 /dev/vda rw
91 90 0:50 / /var/cache/pdcluster-docker/data/overlay2/abc/merged rw - overlay overlay rw
92 22 0:4 net:[4026532] /run/pdcluster-docker-cache/netns/f49276375e29 rw - nsfs nsfs rw
93 22 0:4 net:[4026533] /run/pdcluster-docker-cache-other/netns/x rw - nsfs nsfs rw
94 22 0:51 / /run/pdcluster-docker-cache/with\\040space rw - tmpfs tmpfs rw
"""


def test_mounts_under_the_roots_deepest_first(tmp_path: Path):
    info = tmp_path / "mountinfo"
    info.write_text(MOUNTINFO)
    found = mount_points_under(Path("/run/pdcluster-docker-cache"), Path("/var/cache/pdcluster-docker/data"),
                               mountinfo=info)
    assert set(found) == {"/var/cache/pdcluster-docker/data", "/var/cache/pdcluster-docker/data/overlay2/abc/merged",
                          "/run/pdcluster-docker-cache/netns/f49276375e29", "/run/pdcluster-docker-cache/with space"}
    assert found.index("/var/cache/pdcluster-docker/data/overlay2/abc/merged") < \
        found.index("/var/cache/pdcluster-docker/data")


def test_a_sibling_with_a_common_prefix_is_left_alone(tmp_path: Path):
    info = tmp_path / "mountinfo"
    info.write_text(MOUNTINFO)
    assert "/run/pdcluster-docker-cache-other/netns/x" not in mount_points_under(
        Path("/run/pdcluster-docker-cache"), mountinfo=info)
