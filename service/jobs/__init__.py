"""The job contract shared by the producer (the HTTP facade, `kvstitch ingest`) and the consumer (`workers/`):
what a job is (`documents`), how it travels (`queue`), where it stands (`status`), in which order jobs for one
document apply (`ordering`) and how it is submitted (`submit`). Neither side imports the other."""
