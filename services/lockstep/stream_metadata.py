"""The Step stream's metadata: which coordinator a stream comes from, and the rank's word that it drives it.

A rank takes a newer stream of the coordinator that drives it (a reconnect), and refuses another coordinator's
while that one's stream lives (`rank.service`), so two coordinators never drive one group in turn.
"""

COORDINATOR_METADATA = "x-lockstep-coordinator"  # the coordinator process's id (`rank_link.COORDINATOR_ID`)
STREAM_TAKEN_METADATA = ("x-lockstep-stream", "current")  # a rank's initial metadata once a stream drives it
