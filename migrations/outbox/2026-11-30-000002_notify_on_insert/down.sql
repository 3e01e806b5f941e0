DROP TRIGGER outbox_notify_insert ON outbox;
DROP FUNCTION outbox_notify_insert();
