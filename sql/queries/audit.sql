-- insert_operator_action --
-- One operator action, under its tenant (none for an object of no tenant).
INSERT INTO payhook.operator_actions
       (actor, source, action, object_kind, object_id, tenant_id, event_id, note, result)
VALUES (%(actor)s, %(source)s, %(action)s, %(object_kind)s, %(object_id)s, %(tenant_id)s,
        %(event_id)s, %(note)s, %(result)s)

-- list_operator_actions --
-- A tenant's operator actions, newest first; of one event when %(event_id)s is set.
SELECT id, at, actor, source, action, object_kind, object_id, event_id, note, result
  FROM payhook.operator_actions
 WHERE tenant_id = %(tenant_id)s
   AND (%(event_id)s::text IS NULL OR event_id = %(event_id)s::text)
 ORDER BY at DESC, id DESC
 LIMIT %(limit)s

-- exception_event --
-- The event an exception is about, under its tenant.
SELECT event_id FROM payhook.payment_exceptions WHERE tenant_id = %(tenant_id)s AND id = %(id)s

-- outbox_event --
-- The event an outbox row is about, under its tenant.
SELECT event_id FROM payhook.payment_outbox WHERE tenant_id = %(tenant_id)s AND id = %(id)s
