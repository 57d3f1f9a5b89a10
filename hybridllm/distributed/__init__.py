"""Inter-process communication: shared-memory message queues and device communicators."""
