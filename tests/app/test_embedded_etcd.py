"""The embedded etcd makes the data directory it is given (`kvpush controlplane
--embedded-etcd --etcd-data-dir DIR`, `kvpush etcd --data-dir DIR`) when it does not exist."""

from kvpush.app.etcd_server import EmbeddedEtcd


def test_the_embedded_etcd_makes_a_data_directory_not_made_yet(tmp_path):
    where = tmp_path / "not" / "made" / "yet"
    etcd = EmbeddedEtcd(data_dir=str(where), unsafe_no_fsync=True).start()
    try:
        assert (where / "member-data").is_dir() and (where / "etcd.log").is_file()
    finally:
        etcd.stop()
