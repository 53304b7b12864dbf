"""The processes of a job: parameter servers, trainers beside them (RPC or Ray), and the
supervisor that restarts a job on this host."""
